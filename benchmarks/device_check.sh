#!/usr/bin/env bash
# The device check of docs/movers-cuda.md, for a lent GPU machine: bench_movers.py --json for
# none, int8 and tq4 with host and device (batched) decode, and the store step median. Under 8
# minutes on one H100 / H200 (each codec is its own process, each under its own time limit).
#
#   benchmarks/device_check.sh [OUT_DIR]     # JSON lines in OUT_DIR/movers-<codec>.jsonl
#
# Needs a Python with a CUDA build of torch (the machine's; $PYTHON, default python3). tierkv is
# installed into a virtual environment that sees that torch (--system-site-packages), from this
# checkout, with pip (set PIP_FIND_LINKS / PIP_INDEX_URL where the machine has no index).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-device-check}
mkdir -p "$out"
python=${PYTHON:-python3}
"$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || {
    echo "device_check: $python has no CUDA torch" >&2
    exit 1
}
venv=.venv-device
[ -x "$venv/bin/python" ] || "$python" -m venv --system-site-packages "$venv"
"$venv/bin/python" -c 'import tierkv' 2>/dev/null || "$venv/bin/python" -m pip install --quiet -e .
"$venv/bin/python" -c 'import torch; print("device:", torch.cuda.get_device_name(0), torch.__version__)'
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
for codec in none int8 tq4; do
    staging=()
    [ "$codec" = none ] && staging=(--staging 256MiB)
    timeout 140 "$venv/bin/python" benchmarks/bench_movers.py --json --tokens 30000 \
        --codec "$codec" --decode host device "${staging[@]}" | tee "$out/movers-$codec.jsonl"
done
