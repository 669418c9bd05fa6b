#!/usr/bin/env bash
# The GPU check on a machine without network (docs/gpu.md): installs the wheels of `make gpu-bundle`
# (carried in gpu-bundle/) into a folder, then runs benchmarks/gpu_check.py with reinforge from this
# working tree. Arguments go to gpu_check.py. PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
site=$(benchmarks/gpu_install.sh "${GPU_SITE:-/tmp/reinforge-site}")
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# The CPU references of the tests run PyTorch's path: no C++ build of the CPU kernels on the GPU machine
# (the same numbers within float rounding, tests/unit/kernels/test_cpu_kernels.py).
export REINFORGE_CPU_KERNELS=${REINFORGE_CPU_KERNELS:-0}
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
