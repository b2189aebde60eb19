#!/usr/bin/env bash
# Issue 21: DDP and FSDP2 through torchrun on N GPUs (NCCL) against one GPU with the same global batch.
#
#   bash benchmarks/multi_gpu.sh [N]        (default N=2; OUT, MIXERS, STEPS, MODEL_ARGS and DEVICE override)
#
# For each mixer: one single-process run, then `torchrun --nproc_per_node N` with --distributed ddp and fsdp, all
# with the same global batch (16 sequences of 4096 tokens of the default corpus, hidden 1024, 8 layers, 16 heads,
# each mixer on its default backend), logging every step. Every run is bf16 (the trainer's default on GPU: no
# --no-bf16): the single and DDP runs under bf16 autocast, the FSDP2 runs also with the trainer's
# MixedPrecisionPolicy (bf16 parameters gathered for compute, float32 gradient reduction, float32 shards and
# optimizer state). benchmarks/multi_gpu_report.py then compares each
# distributed run's losses with the single run's (relative difference at every logged step) and its tokens/s,
# and writes multi_gpu.json and multi_gpu.md into OUT. NVLink multicast stays off (the lent machines' rule).
# DEVICE=cpu with a small MODEL_ARGS runs the same pipeline on gloo (the test does that).
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
N=${1:-2}
OUT=${OUT:-benchmarks/results/multi_gpu}
MIXERS=${MIXERS:-"vla tapa path"}
STEPS=${STEPS:-50}
DEVICE=${DEVICE:-cuda}
MODEL_ARGS=${MODEL_ARGS:-"--task lm --seq-len 4096 --hidden-size 1024 --num-layers 8 --num-heads 16 --batch-size 16"}
# shellcheck disable=SC2206
common=($MODEL_ARGS --steps "$STEPS" --log-every 1 --eval-every 0 --checkpoint-every 0 --device "$DEVICE" --quiet)
mkdir -p "$OUT"
for mixer in $MIXERS; do
    python3 -m attnkit train --mixer "$mixer" "${common[@]}" --out "$OUT/$mixer-single" --overwrite
    for mode in ddp fsdp; do
        torchrun --standalone --nproc_per_node "$N" -m attnkit train --mixer "$mixer" "${common[@]}" \
            --distributed "$mode" --out "$OUT/$mixer-$mode" --overwrite
    done
done
python3 benchmarks/multi_gpu_report.py "$OUT" --world-size "$N"
