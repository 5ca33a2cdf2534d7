#!/usr/bin/env bash
# Installs the Debian 12 packages dsv4-replay builds against. Idempotent: does nothing when all are present.
# Usage: scripts/install-deps.sh [--no-gui] [--arm64]
#   --arm64  also the aarch64 cross toolchain, qemu-user-static and the arm64 builds (multiarch) of the
#            libraries the CLI and its CPU tests link (scripts/cross-check.sh); libhdf5-dev cannot be
#            installed for two architectures at once, so cross-check.sh unpacks its arm64 files itself
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libcli11-dev libfmt-dev libxxhash-dev
  libhdf5-dev zlib1g-dev hdf5-tools python3-h5py python3-numpy
  python3-dev pybind11-dev python3-pybind11 python3-pytest  # the Python package (python/) and its tests
  python3-torch  # bench/torch_model.py, the whole-model PyTorch peer, and its test (tests/torch_peer.sh)
  libssl-dev libzip-dev  # adapters/: base64 (OpenSSL EVP), .npz (libzip)
  libisal-dev  # capture/chunk_codec.cpp: fast deflate of trace chunks (zlib without it)
  clang-format libopenmpi-dev openmpi-bin
  clang libclang-rt-14-dev libomp-14-dev  # scripts/fuzz.sh: libFuzzer, sanitizers, OpenMP for clang
)
gui_packages=(qt6-base-dev qt6-charts-dev libqt6opengl6-dev libxkbcommon-dev libgl-dev qt6-svg-dev xvfb xauth)

arm64_packages=(crossbuild-essential-arm64 qemu-user-static libhdf5-103-1:arm64 libxxhash-dev:arm64 libfmt-dev:arm64
  libgtest-dev:arm64 libgmock-dev:arm64 zlib1g-dev:arm64 libgomp1:arm64)
gui=1 arm64=0
for a in "$@"; do
  case "$a" in
    --no-gui) gui=0 ;;
    --arm64) arm64=1 ;;
    *) echo "install-deps.sh: unknown argument '$a' (usage: scripts/install-deps.sh [--no-gui] [--arm64])" >&2; exit 2 ;;
  esac
done
if ((gui)); then packages+=("${gui_packages[@]}"); fi
SUDO=""
if [[ $(id -u) -ne 0 ]]; then SUDO="sudo"; fi
if ((arm64)); then
  packages+=("${arm64_packages[@]}")
  if ! dpkg --print-foreign-architectures | grep -qx arm64; then
    echo "install-deps: adding the arm64 architecture (multiarch)"
    $SUDO dpkg --add-architecture arm64
    $SUDO apt-get update -qq
  fi
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
