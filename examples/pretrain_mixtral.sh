#!/usr/bin/env bash
# Pretrain a Mixtral-style mixture of experts (a Llama-style model whose MLPs are 8 SwiGLU
# experts, each token routed to 2, with the load-balancing loss; docs/moe.md) with torchrun:
# examples/pretrain_llama.sh with the MoE options layered on its defaults. The same environment
# variables apply, and later arguments still override (e.g. --num-experts 16).
set -euo pipefail
exec bash "$(dirname "$0")/pretrain_llama.sh" \
    --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss \
    --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall "$@"
