#!/usr/bin/env bash
# Long context in two phases, on 2 processes (CPUs or GPUs):
#   1. pretrain a small Llama-style model at 2K tokens per sample (2 data-parallel ranks);
#   2. continue it at 8K tokens: the weights of phase 1 (--finetune: a new schedule and a
#      fresh optimizer), Llama 3 RoPE scaling by 4 over the 2K it was trained at, and each
#      8K sequence split over 2 context-parallel ranks (ring attention, --cp-comm-type p2p).
# Builds the quickstart's data first when it is missing. ITERS_2K and ITERS_8K set the
# phases' lengths; RUN the output folder. Later arguments are passed to both phases.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-data/quickstart}
RUN=${RUN:-$DATA/long_context}
if [ ! -f "$DATA/stdlib_text_document.idx" ]; then
    DATA=$DATA bash examples/prepare_data.sh
fi
rm -rf "$RUN"
MODEL=(--num-layers 2 --hidden-size 128 --num-attention-heads 4 --num-query-groups 2
    --lr-warmup-iters 5 --min-lr 1e-4 --lr-decay-style cosine --log-interval 5
    --eval-interval 1000 --eval-iters 1 --hidden-dropout 0.0 --attention-dropout 0.0)

echo "== 1/2 pretrain at 2K tokens (data parallel 2)"
NPROC_PER_NODE=2 DATA=$DATA bash examples/pretrain_llama.sh "${MODEL[@]}" \
    --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 \
    --global-batch-size 4 --train-iters "${ITERS_2K:-30}" --lr 2e-3 \
    --save "$RUN/2k" --save-interval 1000 --log-jsonl "$RUN/2k.jsonl" "$@"

echo "== 2/2 continue at 8K tokens: RoPE scaled by 4, context parallel 2 (ring attention)"
NPROC_PER_NODE=2 DATA=$DATA bash examples/pretrain_llama.sh "${MODEL[@]}" \
    --seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1 \
    --global-batch-size 2 --train-iters "${ITERS_8K:-6}" --lr 5e-4 --lr-warmup-iters 2 \
    --use-rope-scaling --rope-scaling-factor 4 \
    --rope-scaling-original-max-position-embeddings 2048 \
    --context-parallel-size 2 --cp-comm-type p2p \
    --load "$RUN/2k" --finetune --save "$RUN/8k" --save-interval 1000 \
    --log-jsonl "$RUN/8k.jsonl" "$@"
echo "checkpoints: $RUN/2k (2K tokens), $RUN/8k (8K tokens, RoPE scaled)"
