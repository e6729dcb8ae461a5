#!/usr/bin/env bash
# Install rrfp into the active Python environment.
#   ./install.sh          runtime dependencies
#   ./install.sh --test   plus the test tools
# A torch that is already installed (e.g. your CUDA build) is kept; otherwise the CPU build of
# torch 2.13 is installed (override with TORCH_SPEC, e.g. TORCH_SPEC="torch==2.13.0+cu128").
set -euo pipefail
cd "$(dirname "$0")"
PY="${PYTHON:-python}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
extra=""
[ "${1:-}" = "--test" ] && extra="[test]"
# --no-compile: byte-compiling every module of torch, scipy and transformers at install time
# is most of the install on a loaded 2-core machine (torch: 335 s against 174 s; the whole
# install: 1857 s against 1138 s, at load 13-19); Python compiles the modules a program
# imports, once, on first import instead.
# --prefer-binary: a wheel, never a source build, where an older release has one.
PIP=("$PY" -m pip install --disable-pip-version-check -q --no-compile --prefer-binary)
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "${PIP[@]}" ${TORCH_SPEC:-torch==2.13.0}
fi
"${PIP[@]}" -e ".${extra}"
"$PY" -c "import torch, rrfp; print(f'rrfp {rrfp.__version__} with torch {torch.__version__}')"
