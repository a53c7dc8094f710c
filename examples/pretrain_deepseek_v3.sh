#!/usr/bin/env bash
# Pretrain a DeepSeek-V3-style model at proxy size (docs/deepseek_v3.md) with torchrun:
# multi-latent attention with YaRN, a dense first layer then mixtures of experts behind the
# sigmoid router with its expert bias, group-limited routing and a shared expert, one
# multi-token-prediction depth, and Megatron-LM's explicit pipeline layout; the options of
# Megatron-LM's DeepSeek-V3 recipe at a size that trains on a laptop. examples/pretrain_gpt.sh's
# environment variables apply, and later arguments still override (e.g. --num-experts 16).
#
#   PP       pipeline stages: 2 (the default; the layout below: 2 ranks x 2 virtual stages,
#            the embedding and two layers | two layers | one layer | a layer, MTP and loss) or 1
set -euo pipefail
PP=${PP:-2}
case "$PP" in
    2) LAYOUT="Ett|tt|t|tmL" ;;
    1) LAYOUT="Et*6mL" ;;
    *) echo "PP=$PP: use 1 or 2 (or give --pipeline-model-parallel-layout yourself)" >&2; exit 2 ;;
esac
exec bash "$(dirname "$0")/pretrain_gpt.sh" \
    --num-layers 6 --hidden-size 256 --num-attention-heads 8 --ffn-hidden-size 512 \
    --position-embedding-type rope --normalization RMSNorm --norm-epsilon 1e-6 --swiglu \
    --disable-bias-linear --untie-embeddings-and-output-weights \
    --attention-dropout 0.0 --hidden-dropout 0.0 \
    --multi-latent-attention --q-lora-rank 96 --kv-lora-rank 64 --qk-head-dim 32 \
    --qk-pos-emb-head-dim 16 --v-head-dim 32 --qk-layernorm \
    --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 \
    --num-experts 8 --moe-layer-freq "([0]*1+[1]*5)" --moe-ffn-hidden-size 128 \
    --moe-shared-expert-intermediate-size 128 --moe-router-score-function sigmoid \
    --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 --moe-router-topk 4 \
    --moe-router-num-groups 4 --moe-router-group-topk 2 --moe-router-topk-scaling-factor 2.5 \
    --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4 \
    --moe-token-dispatcher-type alltoall \
    --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 \
    --pipeline-model-parallel-size "$PP" --pipeline-model-parallel-layout "$LAYOUT" \
    --recompute-granularity selective --recompute-modules mla_up_proj "$@"
