// Where the tests find the dsv4 binary and the source tree. The paths are compiled into one file
// (paths.cpp), so every test source compiles the same in every checkout and ccache hits across
// clone folders. A target that defines the macros itself (tests/gpu, tests/gui) keeps its own.
#pragma once

namespace dsv4::test {
const char* cli_path();
const char* source_dir();
}  // namespace dsv4::test

#ifndef DSV4_CLI_PATH
#define DSV4_CLI_PATH (::dsv4::test::cli_path())
#endif
#ifndef DSV4_SOURCE_DIR
#define DSV4_SOURCE_DIR (::dsv4::test::source_dir())
#endif
