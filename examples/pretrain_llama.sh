#!/usr/bin/env bash
# Pretrain a Llama-style model (RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases,
# untied embeddings) with torchrun: examples/pretrain_gpt.sh with the Llama options layered on
# its defaults. The same environment variables apply, and later arguments still override.
set -euo pipefail
exec bash "$(dirname "$0")/pretrain_gpt.sh" \
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear \
    --group-query-attention --num-query-groups 4 --untie-embeddings-and-output-weights "$@"
