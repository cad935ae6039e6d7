#!/usr/bin/env bash
# On a machine with CUDA: DDP and FSDP with bf16 on NCCL, one rank per visible GPU (one GPU is
# enough), 50 steps of configs/fsdp_transformer.yaml each; prints each run's backend line, its
# per-rank state and its last records.
#   bash bench/cuda_check.sh            (from the repository root, with dtrain installed)
set -euo pipefail
python=${PYTHON:-python3}
gpus=$("$python" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 1 ]; then
    echo "cuda_check: no CUDA device visible" >&2
    exit 2
fi
out=${OUT_DIR:-runs/cuda_check}
for mode in ddp fsdp; do
    "$python" -m torch.distributed.run --standalone --nproc_per_node="$gpus" launch/train.py \
        --config configs/fsdp_transformer.yaml parallel.mode="$mode" train.precision=bf16 \
        train.max_steps=50 train.log_every=10 run.out_dir="$out" run.name="$mode" ckpt.resume=none \
        2>&1 | grep -E "backend|state per rank|val_acc|finished" || true
    tail -n 3 "$out/$mode/metrics.jsonl"
done
