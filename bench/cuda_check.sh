#!/usr/bin/env bash
# On a machine with CUDA (one GPU is enough): what the CPU cannot show, one line per figure
# (bench/cuda_check.py says what each part runs). Without a CUDA device it says so and exits 0.
#   bash bench/cuda_check.sh            (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" bench/cuda_check.py "$@"
