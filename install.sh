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
# --prefer-binary: a wheel, never a source build, where an older release has one.
# Modules are byte-compiled at install time (no --no-compile): where PYTHONDONTWRITEBYTECODE
# is set, as on this project's machines, nothing would ever write them later, and every
# process of the test suite would compile torch's and transformers' sources again.
PIP=("$PY" -m pip install --disable-pip-version-check -q --prefer-binary)
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "${PIP[@]}" ${TORCH_SPEC:-torch==2.13.0}
fi
"${PIP[@]}" -e ".${extra}"
# An editable install leaves rrfp's own modules uncompiled, and with PYTHONDONTWRITEBYTECODE
# every process (each rank, launcher and daemon the tests start) compiled them again: 0.5 s of
# CPU per rrfp train rank. Compiled here once; Python checks each .pyc against its source, so
# an edited module is compiled afresh, never run stale.
"$PY" -m compileall -q -j 0 rrfp benchmarks tests >/dev/null
"$PY" -c "import torch, rrfp; print(f'rrfp {rrfp.__version__} with torch {torch.__version__}')"
