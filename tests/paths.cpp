// The paths of tests/paths.h (DSV4_TEST_CLI_PATH and DSV4_TEST_SOURCE_DIR come from tests/CMakeLists.txt).
#include "paths.h"

namespace dsv4::test {
const char* cli_path() { return DSV4_TEST_CLI_PATH; }
const char* source_dir() { return DSV4_TEST_SOURCE_DIR; }
}  // namespace dsv4::test
