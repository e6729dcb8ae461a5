#!/usr/bin/env bash
# The one-GPU check (python -m rrfp.gpu_check): exit 0 passed, 1 failed, 77 no CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m rrfp.gpu_check "$@"
