# Cross-compiles dsv4-replay for aarch64 (Grace-class hosts) with Debian's cross toolchain
# (crossbuild-essential-arm64) and runs what it builds under qemu-user-static. Used by
# scripts/cross-check.sh, which installs the packages and prepares DSV4_ARM64_SYSROOT:
#
#   cmake -S . -B build-aarch64 --toolchain cmake/aarch64-linux-gnu.cmake \
#         -DDSV4_ARM64_SYSROOT=build-aarch64/sysroot
#
# Libraries come from Debian's arm64 packages installed side by side with the amd64 ones (multiarch:
# /usr/lib/aarch64-linux-gnu). libhdf5-dev cannot be installed for two architectures at once, so its
# arm64 files (headers with their arm64 H5pubconf.h, the unversioned .so) are unpacked into
# DSV4_ARM64_SYSROOT; the runtime library libhdf5-103-1:arm64 is a multiarch package.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)

# Test binaries (and gtest_discover_tests) run under the emulator; programs that tests start by path
# (the dsv4 CLI) run through binfmt_misc, which scripts/cross-check.sh registers.
find_program(DSV4_QEMU_AARCH64 qemu-aarch64-static REQUIRED)
set(CMAKE_CROSSCOMPILING_EMULATOR ${DSV4_QEMU_AARCH64})

set(DSV4_ARM64_SYSROOT "" CACHE PATH "Folder holding libhdf5-dev:arm64 unpacked (scripts/cross-check.sh makes it)")
list(APPEND CMAKE_TRY_COMPILE_PLATFORM_VARIABLES DSV4_ARM64_SYSROOT)  # try_compile reads this file again
if(NOT DSV4_ARM64_SYSROOT OR NOT EXISTS "${DSV4_ARM64_SYSROOT}/usr/include/hdf5/serial/hdf5.h")
  message(FATAL_ERROR "aarch64 toolchain: DSV4_ARM64_SYSROOT ('${DSV4_ARM64_SYSROOT}') does not hold "
                      "usr/include/hdf5/serial/hdf5.h; scripts/cross-check.sh --aarch64 prepares it")
endif()
get_filename_component(DSV4_ARM64_SYSROOT "${DSV4_ARM64_SYSROOT}" ABSOLUTE)

# Headers and libraries: the arm64 multiarch folders of the host and the unpacked sysroot; never the
# host's amd64 ones. Programs (code generators, pkg-config) are the host's.
set(CMAKE_FIND_ROOT_PATH "${DSV4_ARM64_SYSROOT}" /)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(ENV{PKG_CONFIG_LIBDIR} "/usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig")
set(ENV{PKG_CONFIG_PATH} "")

# HDF5: the host's h5cc would report the amd64 paths, so name the arm64 files directly.
set(HDF5_C_COMPILER_EXECUTABLE "" CACHE FILEPATH "not used when cross-compiling" FORCE)
set(HDF5_C_INCLUDE_DIR "${DSV4_ARM64_SYSROOT}/usr/include/hdf5/serial" CACHE PATH "" FORCE)
set(HDF5_hdf5_LIBRARY_RELEASE /usr/lib/aarch64-linux-gnu/libhdf5_serial.so.103 CACHE FILEPATH "" FORCE)
