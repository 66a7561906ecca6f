# CMake toolchain file: cross-compile the engine, colibri_cli, colibri_bench, the C tests and
# (when the aarch64 libmicrohttpd and jansson are there) colibri_server for 64-bit ARM Linux
# with Debian's cross compiler (apt-get install gcc-aarch64-linux-gnu), then run what it
# built under qemu-user (apt-get install qemu-user): docs/portability.md.
#
#   cmake -S native -B build/aarch64 -DCMAKE_TOOLCHAIN_FILE=$PWD/native/cmake/aarch64-linux-gnu.cmake \
#         -DCOLIBRI_BUILD_TESTS=ON
#   cmake --build build/aarch64 -j
#   qemu-aarch64 build/aarch64/test_kernels     (-L /usr/aarch64-linux-gnu without libc6:arm64)
#
# The C tests are run through qemu by ctest as well (CMAKE_CROSSCOMPILING_EMULATOR below).
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(COLIBRI_CROSS_PREFIX "aarch64-linux-gnu-" CACHE STRING "prefix of the cross tools")
set(CMAKE_C_COMPILER "${COLIBRI_CROSS_PREFIX}gcc")
set(CMAKE_CXX_COMPILER "${COLIBRI_CROSS_PREFIX}g++")

# Debian's multiarch root of the aarch64 libc (and of any :arm64 -dev packages installed)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu /usr/lib/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)

# pkg-config (colibri_server's libmicrohttpd and jansson) must see the aarch64 packages
# (apt-get install libmicrohttpd-dev:arm64 libjansson-dev:arm64 after dpkg --add-architecture
# arm64), never the build machine's: without them colibri_server is skipped with a warning.
set(ENV{PKG_CONFIG_LIBDIR} "/usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig")
set(ENV{PKG_CONFIG_PATH} "")

# ctest runs the test executables under user-mode emulation. Where Debian's multiarch arm64
# libc is installed (it comes with libmicrohttpd-dev:arm64), qemu finds its loader at
# /lib/ld-linux-aarch64.so.1 and must not be given the cross libc's root as well: with
# -L /usr/aarch64-linux-gnu it would pair that root's loader with the multiarch libc.so.6 (the
# path falls through to the host's /lib/aarch64-linux-gnu), a mismatch that hangs in
# pthread_create. Without the multiarch libc, the cross root is the only one there is.
find_program(COLIBRI_QEMU_AARCH64 qemu-aarch64)
if(COLIBRI_QEMU_AARCH64)
  if(EXISTS /lib/ld-linux-aarch64.so.1)
    set(CMAKE_CROSSCOMPILING_EMULATOR "${COLIBRI_QEMU_AARCH64}")
  else()
    set(CMAKE_CROSSCOMPILING_EMULATOR "${COLIBRI_QEMU_AARCH64};-L;/usr/aarch64-linux-gnu")
  endif()
endif()
