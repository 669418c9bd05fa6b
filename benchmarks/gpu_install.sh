#!/usr/bin/env bash
# Installs the wheels of `make gpu-bundle` into a folder, with no network, on a machine whose Python
# has the rest (the GPU image: torch, transformers, ...). Prints the PYTHONPATH to use.
#   benchmarks/gpu_install.sh [TARGET]      (default /tmp/reinforge-site; BUNDLE=gpu-bundle, PYTHON=python3)
set -euo pipefail
cd "$(dirname "$0")/.."
target=${1:-/tmp/reinforge-site}
bundle=${BUNDLE:-gpu-bundle}
python=${PYTHON:-python3}
shopt -s nullglob
wheels=("$bundle"/wheels/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
    echo "no wheels in $bundle/wheels: run 'make gpu-bundle' on a machine with network first" >&2
    exit 2
fi
"$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --disable-pip-version-check --target "$target" "${wheels[@]}" >&2
echo "$target"
