#!/usr/bin/env bash
# Pretrain a GPT-2-style model with torchrun. Every argument is passed to the engine after the
# defaults below, so a later flag overrides a default (e.g. --num-layers 24).
#
#   NPROC_PER_NODE   processes on this machine (default: the GPU count, or 4 without GPUs)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   for several machines (default: one machine,
#                    on a free port torchrun picks)
#   DATA             folder with the quickstart's dataset and tokenizer (default data/quickstart)
#   PYTHON           the interpreter with the engine installed (default: python on PATH)
#   MAX_RESTARTS     restart every rank this many times after a failure (torchrun's
#                    --max-restarts, default 0); each restart resumes from the newest
#                    checkpoint when --load equals --save
#   PRECISION        bf16 (the default with GPUs: bf16 weights and activations, fp32 master
#                    weights and gradients) or fp32 (the default without); --fp16 or --bf16
#                    among the arguments decide instead
#
# Without GPUs the ranks use gloo on the CPU with one thread each. On GPUs the engine also
# turns on TF32 for fp32 matmuls, pins the batches' memory for asynchronous copies and lets
# PyTorch's attention pick FlashAttention (bf16).
set -euo pipefail

PYTHON=${PYTHON:-python}
if ! "$PYTHON" -c 'import importlib.util, sys, engine
sys.exit(importlib.util.find_spec("torch") is None)' 2>/dev/null; then
    echo "error: $PYTHON cannot import torch and the engine; activate the project's" \
        "environment (source .venv/bin/activate after make venv) or set PYTHON to its python" >&2
    exit 2
fi
# the GPUs this process may use, as torch sees them (CUDA_VISIBLE_DEVICES and a Slurm
# allocation included, which `nvidia-smi -L` ignores); with CUDA_VISIBLE_DEVICES set empty
# there are none, and no need to spend the seconds importing torch takes to count them
if [ -n "${CUDA_VISIBLE_DEVICES+set}" ] && [ -z "$CUDA_VISIBLE_DEVICES" ]; then
    gpus=0
else
    gpus=$("$PYTHON" -c 'import torch
print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
fi
if [ "$gpus" -gt 0 ]; then
    NPROC_PER_NODE=${NPROC_PER_NODE:-$gpus}
else
    NPROC_PER_NODE=${NPROC_PER_NODE:-4}
    export OMP_NUM_THREADS=1
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
# One machine with no MASTER_PORT given: torchrun's standalone rendezvous takes a free port
# itself, so two runs on one machine never collide on a fixed one.
if [ "$NNODES" = 1 ] && [ -z "${MASTER_PORT:-}" ]; then
    RENDEZVOUS_ARGS=(--standalone)
else
    RENDEZVOUS_ARGS=(--nnodes "$NNODES" --node-rank "$NODE_RANK"
        --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}")
fi
DATA=${DATA:-data/quickstart}
if [ "$gpus" -gt 0 ]; then PRECISION=${PRECISION:-bf16}; else PRECISION=${PRECISION:-fp32}; fi
case "$PRECISION" in
    bf16) PRECISION_ARGS=(--bf16) ;;
    fp32) PRECISION_ARGS=() ;;
    *) echo "PRECISION=$PRECISION: use bf16 or fp32 (or pass --fp16)" >&2; exit 2 ;;
esac

# Defaults: what Megatron-LM requires (the model's shape, the batch, the length, the data) and
# a learning rate; every other flag keeps Megatron-LM's default. A group of defaults is left
# out when the arguments give their own: the data and split with any data source (--data-path,
# --mock-data, per-split paths, --data-args-path), the tokenizer with any tokenizer flag, the
# length with --train-samples (Megatron-LM refuses the two together), the global batch with a
# step schedule.
MODEL_ARGS=(
    --num-layers 4 --hidden-size 256 --num-attention-heads 8
    --seq-length 256 --max-position-embeddings 256
)
TRAIN_ARGS=(--micro-batch-size 4 --lr 1e-3)
BATCH_ARGS=(--global-batch-size 16)
LENGTH_ARGS=(--train-iters 200)
DATA_ARGS=(--data-path "$DATA/stdlib_text_document" --split 949,50,1)
TOKENIZER_ARGS=(--tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/tokenizer.model")
for arg in "$@"; do
    case "${arg%%=*}" in
        --train-samples) LENGTH_ARGS=() ;;
        --step-batch-size-schedule) BATCH_ARGS=() ;;
        --data-path | --mock-data | --train-data-path | --valid-data-path | --test-data-path | \
            --data-args-path | --per-split-data-args-path) DATA_ARGS=() ;;
        --tokenizer-type | --tokenizer-model | --vocab-file | --merge-file) TOKENIZER_ARGS=() ;;
        --fp16 | --bf16) PRECISION_ARGS=() ;;
    esac
done
OUTPUT_ARGS=(--log-interval 10 --eval-interval 100 --eval-iters 4)

# engine.launch is torchrun (same options) that first checks every flag, path and the layout
# for the world size, so a mistake is one line and exit code 2 before any rank starts; running
# it through $PYTHON picks the right environment.
exec "$PYTHON" -m engine.launch --nproc-per-node "$NPROC_PER_NODE" "${RENDEZVOUS_ARGS[@]}" \
    --max-restarts "${MAX_RESTARTS:-0}" \
    -m engine.pretrain "${MODEL_ARGS[@]}" "${TRAIN_ARGS[@]}" \
    ${BATCH_ARGS[@]+"${BATCH_ARGS[@]}"} ${LENGTH_ARGS[@]+"${LENGTH_ARGS[@]}"} \
    ${DATA_ARGS[@]+"${DATA_ARGS[@]}"} ${TOKENIZER_ARGS[@]+"${TOKENIZER_ARGS[@]}"} \
    ${PRECISION_ARGS[@]+"${PRECISION_ARGS[@]}"} "${OUTPUT_ARGS[@]}" "$@"
