#!/usr/bin/env bash
# The paper-scale checks that need a GPU, in one run (at most ~8 minutes on one H200):
#   bench/gpu_check.sh OUTDIR          on a CUDA machine: flex replay parity (fp32, bf16, forward and backward),
#                                      one naive_sparse and one smd step of qwen3_4b_random with per-phase CUDA
#                                      peaks beside `smd plan`'s predictions, decode tokens/s, optim=adamw8bit
#   bench/gpu_check.sh --cpu OUTDIR    the same checks on the CPU at one layer of Qwen3-4B's widths (~2 min): before a GPU run
#   bench/gpu_check.sh --cpu --narrow OUTDIR   the same at narrow widths (seconds: how the suite tests it)
# Writes OUTDIR/gpu_check.json; exits non-zero if a check failed. See bench/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
cpu=()
if [ "${1:-}" = "--cpu" ]; then cpu=(--cpu); shift; fi
if [ "${1:-}" = "--narrow" ]; then cpu+=(--narrow); shift; fi
[ $# -eq 1 ] || { echo "usage: bench/gpu_check.sh [--cpu [--narrow]] OUTDIR" >&2; exit 2; }
exec "$PYTHON" bench/gpu_check.py "$1" "${cpu[@]}"
