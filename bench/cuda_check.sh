#!/usr/bin/env bash
# On a machine with CUDA (one GPU is enough): what the CPU cannot show. Each run prints its
# backend line, per-rank state, start-up, throughput and last records.
#   1. DDP and FSDP with bf16 on NCCL (configs/fsdp_transformer.yaml, 50 steps);
#   2. the default CNN with channels_last and bf16 under DDP;
#   3. the language model (configs/gpt_text.yaml, bf16): tokens/s and MFU;
#   4. steady-state steps with train.sync_debug=true: torch's warnings at every host-device
#      synchronisation inside a step (there should be none; the count is printed).
#   bash bench/cuda_check.sh            (from the repository root, with dtrain installed)
set -euo pipefail
python=${PYTHON:-python3}
gpus=$("$python" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 1 ]; then
    echo "cuda_check: no CUDA device visible" >&2
    exit 2
fi
out=${OUT_DIR:-runs/cuda_check}
run() {  # name, then config and overrides
    local name=$1
    shift
    "$python" -m torch.distributed.run --standalone --nproc_per_node="$gpus" launch/train.py \
        "$@" run.out_dir="$out" run.name="$name" ckpt.resume=none 2>&1 |
        tee "$out.$name.log" | grep -E "backend|state per rank|start-up|val_|finished" || true
    tail -n 2 "$out/$name/metrics.jsonl"
}
mkdir -p "$(dirname "$out")"
for mode in ddp fsdp; do
    run "transformer-$mode" --config configs/fsdp_transformer.yaml parallel.mode="$mode" \
        train.precision=bf16 train.max_steps=50 train.log_every=10
done
run cnn-channels-last --config configs/default.yaml model.channels_last=true train.precision=bf16 \
    train.max_steps=200 train.log_every=50
run gpt --config configs/gpt_text.yaml train.precision=bf16 train.max_steps=200 train.log_every=50
run sync-debug --config configs/default.yaml train.sync_debug=true train.max_steps=60 \
    train.log_every=1000 train.check_every_steps=1000 train.eval_every_epochs=0
echo "cuda_check: synchronising operations warned about inside steps:" \
    "$(grep -c "called a synchronizing CUDA operation" "$out.sync-debug.log" || true)"
