#!/usr/bin/env bash
# One device session's checks of the `cuda` backend, as a single command run from
# the repository root on a GPU machine that has torch and triton but cannot
# reach PyPI (the workplace's H200 image lacks gguf, which the engine imports).
#
# Before (on a machine with PyPI), from the repository root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl gguf==0.19.0
# Then run this script there with `.whl` carried along; results land in $OUT
# (or ./gpu-results): gpu_check.log/.json, and with --tune the device's tuned-config
# file (e.g. NVIDIA_H200.json).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-results}"
mkdir -p "$out"
log=gpu_check.log
# One process (kernels compile once), stopped in time: the device tool's commands run at
# most 600 s, so by default no section or tune configuration starts after 540 s and the
# JSON is rewritten after every section. GPU_CHECK_DEADLINE overrides the 540.
args=(--json "$out/gpu_check.json" --deadline "${GPU_CHECK_DEADLINE:-540}")
case "${1:-}" in
    # The tune section runs last and also writes $out/<device>.json, the tuned-config file
    # the kernels look up: copy it to infer/backends/cuda/configs/ and commit it.
    --tune) args+=(--tune --write-config "$out") ;;
    # A second command when the first ran out of time before tuning.
    --tune-only) args=(--json "$out/tune.json" --deadline "${GPU_CHECK_DEADLINE:-540}" --only tune
                       --write-config "$out"); log=tune.log ;;
    "") ;;
    *) echo "usage: $0 [--tune | --tune-only]" >&2; exit 2 ;;
esac
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/infer-site .whl/*.whl \
        || exit 1
    export PYTHONPATH="/tmp/infer-site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$out/nvidia-smi.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 benchmarks/gpu_check.py "${args[@]}" 2>&1 | tee "$out/$log"
exit "${PIPESTATUS[0]}"
