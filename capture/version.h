// The dsv4 version, defined once by CMake (project(... VERSION ...)): the traces' producer, the
// command's --version and the viewer's application version.
#pragma once

namespace dsv4 {

const char* version();

}  // namespace dsv4
