#!/usr/bin/env bash
# On a machine with CUDA (one GPU is enough): what the CPU cannot show, one line per figure
# and a table at the end (bench/cuda_check.py says what each part runs). Without a CUDA device
# it says so and exits 0; --cpu-try runs every part on the CPU at tiny sizes, to try the script.
#   bash bench/cuda_check.sh [OUT_DIR] [--only 1,2,3,4,5,6,7,8] [--cpu-try]
#                                       (from the repository root; the project's .venv if made,
#                                        else python3; PYTHON=... to choose)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
exec "$PYTHON" bench/cuda_check.py "$@"
