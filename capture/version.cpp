#include "capture/version.h"

namespace dsv4 {

const char* version() {
  return DSV4_VERSION;  // set on this file alone by capture/CMakeLists.txt
}

}  // namespace dsv4
