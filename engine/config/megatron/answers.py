"""The answer to every Megatron-LM training flag this engine does not implement: the one table.

Megatron-LM's flags (the lists beside this file, engine/config/megatron/releases.py) get one
answer each (tests/test_megatron_table.py fails on a flag without one):

1. implemented with Megatron-LM's meaning: the flags of this engine's own configs
   (engine/config/*.py); not listed here;
2. `NO_EFFECT`: accepted and named at start as without effect, because it only picks a
   kernel, a fusion, a communication or allocator habit, a checkpoint container detail or
   something else that cannot change results here (grouped by that reason);
3. `MISSING`: refused in one line naming the feature this engine lacks (grouped by feature);
4. `NOT_APPLICABLE`: refused in one line saying what the flag is for (inference, RL,
   multimodal, BERT/T5, export, distillation), which is not pretraining GPT-style models.

A refused flag given at Megatron-LM's default value changes nothing there either, and is
accepted without effect (engine/config/megatron/compat.py).
"""

from __future__ import annotations

# Implemented flags whose default here is not Megatron-LM's literal default, and why (a test
# compares every other implemented flag's default with Megatron-LM's).
DIFFERENT_DEFAULTS: dict[str, str] = {
    "--lr": "Megatron-LM has none (a run without --lr fails in its scheduler); 3e-4 here",
    "--rerun-mode": (
        "Megatron-LM's validate_results computes a NaN/Inf step again and then stops the job "
        "(checkpointing a reproduced one for a rerun on another GPU); here such a step is "
        "skipped unless --rerun-mode validate_results (or --rerun-on-nan) computes it again "
        "and goes on"
    ),
    "--transformer-impl": (
        "Megatron-LM's transformer_engine needs Transformer Engine; local (the same "
        "computation in PyTorch) here"
    ),
    "--distributed-backend": (
        "Megatron-LM's nccl; here the device's backend (nccl on GPUs, gloo on the CPU), and "
        "the flag is checked against the device"
    ),
    "--no-overlap-p2p-communication": (
        "Megatron-LM overlaps the interleaved schedule's transfers unless this flag is given; "
        "here they overlap only with --overlap-p2p-communication (speed only, same results)"
    ),
    "--num-query-groups": (
        "Megatron-LM's 1 is read only with --group-query-attention; unset here means the same"
    ),
    "--data-parallel-sharding-strategy": (
        "Megatron-LM's optim_grads_params is read only with --use-megatron-fsdp; unset here "
        "means the same"
    ),
    "--profile-ranks": (
        "core_v0.16.1 profiles rank 0 unless told, core_v0.19.0 every rank (an empty list); "
        "every rank here, as the newer release"
    ),
    "--split": (
        "Megatron-LM's None becomes 969,30,1 when no per-split data paths are given; the same here"
    ),
}


def _table(text: str) -> dict[str, tuple[str, ...]]:
    """{group: its flags} from lines `<group>:` each followed by indented lines of flags."""
    table: dict[str, tuple[str, ...]] = {}
    group = None
    for line in text.strip("\n").splitlines():
        if line.startswith(" "):
            table[group] += tuple(line.split())
        else:
            group = line.removesuffix(":")
            table[group] = ()
    return table


# accepted without effect: why it cannot change results here
NO_EFFECT = _table("""
CUDA graphs:
    --cuda-graph-impl --cuda-graph-modules --cuda-graph-scope --cuda-graph-warmup-steps
    --enable-cuda-graph --external-cuda-graph --optimizer-cuda-graph --te-rng-tracker
Megatron-FSDP buffer or gather detail:
    --fsdp-db-use-persist-buf-on-alloc-fail --fsdp-double-buffer --fsdp-manual-registration
    --megatron-fsdp-enable-fine-grained-param-gather --megatron-fsdp-max-pool-double-buffer
    --suggested-communication-unit-size
Transformer Engine userbuffer overlap:
    --disable-tp-comm-bulk-dgrad --disable-tp-comm-bulk-wgrad --disable-tp-comm-overlap-ag
    --disable-tp-comm-overlap-rs --disable-tp-comm-split-ag --disable-tp-comm-split-rs
    --no-tp-comm-bulk-dgrad --no-tp-comm-bulk-wgrad --no-tp-comm-overlap-ag
    --no-tp-comm-overlap-rs --no-tp-comm-split-ag --no-tp-comm-split-rs
    --tp-comm-bootstrap-backend --tp-comm-overlap --tp-comm-overlap-cfg
    --tp-comm-overlap-rs-dgrad
a Transformer Engine kernel or fusion:
    --cross-entropy-fusion-impl --delay-wgrad-compute --flash-attention-version
    --fused-residual-rmsnorm --use-grouped-gemm-for-dense-mlp --use-transformer-engine-op-fuser
a checkpoint container or writer detail:
    --auto-detect-ckpt-format --ckpt-assume-constant-structure --ckpt-format
    --ckpt-fully-parallel-load --ckpt-fully-parallel-load-exchange-algo
    --ckpt-fully-parallel-load-process-group --ckpt-fully-parallel-save-process-group
    --disable-ckpt-fully-parallel-save --disable-ckpt-load-validate-sharding-integrity
    --disable-stream-ckpt-dequant --dist-ckpt-format --dist-ckpt-save-pre-mcore-014
    --distrib-optim-fully-reshardable-mem-efficient --no-ckpt-fully-parallel-save
    --no-ckpt-load-validate-sharding-integrity --no-stream-ckpt-dequant --use-dist-ckpt
a communication backend or NCCL setting:
    --disable-gloo-process-groups --disable-symmetric-registration
    --nccl-communicator-config-path --pipeline-model-parallel-comm-backend --sharp-enabled-group
    --symmetric-ar-type --use-nccl-ub --use-sharp
a communication bucket, stream or overlap habit:
    --create-all-gather-group --ddp-num-buckets --ddp-pad-buckets-for-high-nccl-busbw
    --disable-align-grad-reduce --high-priority-stream-groups --no-align-grad-reduce
    --no-align-param-gather --no-gradient-reduce-div-fusion
    --no-scatter-gather-tensors-in-pipeline --overlap-p2p-communication-warmup-flush
    --overlap-param-gather-with-optimizer-step --use-ring-exchange-p2p
a data loader detail (no attention mask is ever made by the loader here):
    --no-create-attention-mask-in-dataloader
a data loader detail (the .bin files are always memory-mapped here):
    --no-mmap-bin-files
a host-side habit (garbage collection, signals, CPU-GPU sync):
    --disable-manual-gc-eval --exit-signal-handler-for-dataloader --manual-gc
    --manual-gc-interval --no-manual-gc-eval --train-sync-interval
a memory-release detail:
    --disable-clone-scatter-output-in-embedding --empty-unused-memory-level
    --no-clone-scatter-output-in-embedding
already what tripod does:
    --accumulate-allreduce-grads-in-fp32 --apply-query-key-layer-scaling
    --attention-softmax-in-fp32 --dist-ckpt-optim-fully-reshardable
    --log-throughput --log-timers-to-tensorboard --log-validation-ppl-to-tensorboard
    --tokenizer-hf-use-fast --use-cpu-initialization --verify-integrity
background checkpoint writer detail:
    --async-ckpt-cpu-priority --async-ckpt-io-priority --async-ckpt-use-cpu-shm --async-strategy
    --dist-ckpt-workers --use-persistent-ckpt-worker
chooses megatron-core's models over the legacy ones, the only kind here:
    --use-mcore-models
dataset index loading speed:
    --dataloader-defer-npy-index-mmap --dataloader-fast-cache-load --num-dataset-builder-threads
    --per-dataset-sequences-path
gate for Megatron-LM's experimental code (no effect alone):
    --enable-experimental
gradient scaling inside the collective (NCCL's average scales each input by 1/DP as here):
    --ddp-average-in-collective
launcher plumbing:
    --local-rank
moves the output layer's weight-gradient GEMMs to the pipeline flush (the same gradients):
    --defer-embedding-wgrad-compute --wgrad-deferral-limit
picks a kernel or fusion:
    --attention-backend --cross-entropy-loss-fusion --disable-jit-fuser --moe-deepep-num-sms
    --mla-down-proj-fusion --moe-enable-deepep --moe-flex-dispatcher-backend
    --moe-hybridep-num-sms --moe-permute-fusion --moe-router-fusion --moe-use-legacy-grouped-gemm
    --no-bias-dropout-fusion --no-bias-swiglu-fusion --no-masked-softmax-fusion
    --no-persist-layer-norm --no-rope-fusion --use-flash-attn
retired Megatron-LM flag it ignores itself:
    --ckpt-fully-parallel-save --disable-async-tensor-model-parallel-allreduce --disable-msc
    --no-async-tensor-model-parallel-allreduce
skips initialisation (weights come from --load):
    --no-initialization
telemetry (NVIDIA one-logger):
    --app-tag-run-name --app-tag-run-version --no-one-logger --one-logger-async
    --one-logger-project --one-logger-run-name
with --position-embedding-type rope there is no learned position embedding:
    --no-position-embedding
""")

# refused: the feature this engine lacks
MISSING = _table("""
FP4 training, Transformer Engine's quantizer factories and precision files, NVIDIA Kitchen:
    --fp4-format --fp4-param-gather --fp4-quantizer-factory --fp4-recipe --fp8-output-proj
    --fp8-quantizer-factory --keep-fp8-transpose-cache --kitchen-attention-backend
    --kitchen-config-file --kitchen-recipe-number --reuse-grad-buf-for-mxfp8-param-ag
    --te-precision-config-file --use-kitchen-attention
Mamba and hybrid models:
    --disable-mamba-mem-eff-path --hybrid-attention-ratio --hybrid-layer-pattern
    --hybrid-mlp-ratio --hybrid-override-pattern --is-hybrid-model --mamba-head-dim
    --mamba-num-groups --mamba-num-heads --mamba-state-dim --mamba-training-ssm-states-dtype
Megatron-LM's GELU form (tanh-approximate fused bias-GELU):
    --use-te-activation-func
Megatron-LM's legacy GPT model (megatron.legacy):
    --use-legacy-models
Multi-Storage Client / object storage:
    --enable-msc --object-storage-cache-path
Lion, Lion for Muon's other parameters, and the layer-wise distributed optimizer's layouts:
    --lion-beta1 --lion-beta2 --muon-scalar-optimizer --no-use-layer-wise-param-layout
NCCL flight-recorder dumps:
    --disable-flight-recorder-dump-on-timeout --disable-flight-recorder-extra-dump-on-exec
    --disable-flight-recorder-include-only-active --flight-recorder-dump-path
    --flight-recorder-include-stack-trace --flight-recorder-trace-buffer-size
    --no-flight-recorder-dump-on-timeout --no-flight-recorder-extra-dump-on-exec
    --no-flight-recorder-include-only-active
QK-clip (MuonClip):
    --log-max-attention-logit --qk-clip --qk-clip-alpha --qk-clip-threshold
RoPE variants:
    --no-rope-freq
activation and optimizer CPU offloading:
    --activation-offload-fraction --cpu-offloading-num-layers
    --cpu-offloading-retain-pinned-cpu-buffers --delay-offload-until-cuda-graph
    --delta-offload-bytes-across-pp-ranks --fine-grained-activation-offloading
    --fine-grained-offloading-max-inflight-offloads --min-offloaded-tensor-size
    --no-pin-cpu-grads --no-pin-cpu-params --offload-modules --optimizer-cpu-offload
    --optimizer-offload-fraction --overlap-cpu-optimizer-d2h-h2d
    --use-torch-optimizer-for-cpu-offload
activation-recomputation options:
    --distribute-saved-activations
attention variants:
    --attention-output-gate --qk-l2-norm
batch-invariant kernels:
    --batch-invariant-mode
batch-size adjustment:
    --decrease-batch-size-if-needed
blended-dataset surplus (data order):
    --mid-level-dataset-surplus
checkpoint load and save policy:
    --ckpt-step --disable-use-tokenizer-model-from-checkpoint-args --load-main-params-from-ckpt
    --no-save-optim --no-save-rng --no-use-tokenizer-model-from-checkpoint-args
    --override-ckpt-iteration --pretrained-checkpoint --use-mp-args-from-checkpoint-args
custom module specs and YAML configs:
    --spec --yaml-cfg
cyclic data loader:
    --dataloader-type --no-data-sharding
evaluation options:
    --full-validation
    --multiple-validation-sets --skip-train --start-eval-at-iter --validation-set-names
exit-signal options:
    --exit-signal-handler-for-training
experimental attention variants (DSA, gated delta net):
    --disable-dsa-indexer-rotate-activation --disable-dsa-indexer-scoring-relu
    --dsa-indexer-head-dim --dsa-indexer-k-norm-epsilon --dsa-indexer-k-norm-fp32
    --dsa-indexer-loss-coeff --dsa-indexer-n-heads --dsa-indexer-rope-interleaved
    --dsa-indexer-skip-topk-offset --dsa-indexer-topk --dsa-indexer-topk-freq
    --dsa-indexer-use-sparse-loss --dsa-kernel-backend --experimental-attention-variant
    --linear-attention-freq --linear-conv-kernel-dim --linear-key-head-dim
    --linear-num-key-heads --linear-num-value-heads --linear-value-head-dim
    --no-dsa-indexer-rotate-activation --no-dsa-indexer-scoring-relu
fake process groups:
    --fake-process-group
generalized tensor-parallel weight sharding:
    --tensor-parallel-num-weight-shards
gradient-reduction and FSDP buffer dtypes:
    --ddp-param-name-patterns-for-fp32-local-accumulation
    --ddp-reduce-scatter-with-fp32-accumulation --megatron-fsdp-grad-comm-dtype
    --megatron-fsdp-main-grads-dtype --megatron-fsdp-main-params-dtype
heterogeneous layer configs:
    --heterogeneous-layers-config-encoded-json --heterogeneous-layers-config-path
hierarchical context parallelism:
    --hierarchical-context-parallel-sizes
hybrid sharded data parallelism (HSDP) beyond replicated optimizer instances:
    --enable-full-sharding-in-hsdp --outer-dp-sharding-strategy
initialisation variants:
    --data-parallel-random-init --embedding-init-method-std --init-method-xavier-uniform
layer freezing:
    --freeze-all-layers
logging and TensorBoard options:
    --config-logger-dir --disable-log-loss-scale-to-tensorboard --log-device-memory-used
    --log-energy --log-memory-interval --log-progress --log-world-size-to-tensorboard
    --no-barrier-with-level-1-timing --no-log-loss-scale-to-tensorboard
    --timing-log-option
loss masking of pad tokens:
    --allow-ambiguous-pad-tokens
meta-device initialisation (start-up memory under FSDP):
    --init-model-with-meta-device
expert parallelism and the rest of mixture of experts (issue 40):
    --ep-overlap-early-attn-memory-release --expert-tensor-parallel-num-weight-shards
    --high-priority-a2a-comm-stream --moe-enable-routing-replay
    --moe-expert-rank-capacity-factor --moe-extended-tp --moe-flex-dispatcher-num-sms
    --moe-hybridep-num-blocks-permute --moe-hybridep-num-blocks-unpermute
    --moe-hybridep-num-sms-preprocessing --moe-hybridep-pad-uneven-dispatch-inputs
    --moe-latent-size --moe-mlp-glu-interleave-size
    --moe-ncclep-static-shape --moe-ncclep-zero-copy --moe-paged-stash
    --moe-paged-stash-buffer-size-factor-cpu --moe-paged-stash-buffer-size-factor-cuda
    --moe-paged-stash-page-size --moe-permute-fusion-into-hybridep
    --moe-router-force-biased --moe-router-force-load-balancing --moe-router-padding-for-fp8
    --moe-router-padding-for-quantization --moe-router-quantile-balancing-ema
    --moe-routing-trace-capture-hidden-states --moe-routing-trace-capture-logits
    --moe-routing-trace-dump-weights --moe-routing-trace-max-training-iters
    --moe-routing-trace-path --moe-shared-expert-glu-interleave-size --moe-single-grouped-bias
    --moe-single-grouped-weight --moe-upcycling-granularity --moe-use-upcycling
    --overlap-dispatch-backward-with-experts-wgrad --overlap-moe-expert-parallel-comm
    --use-fused-weighted-squared-relu --use-grouped-gemm-for-shared-expert
muP parametrization:
    --mup-attn-scale-power --mup-base-head-dim --mup-base-hidden-size --mup-embedding-mult
    --mup-output-mult --mup-width-mult --use-mup
multi-token prediction beyond DeepSeek-V3's (detached heads, standalone stages, shared layer):
    --mtp-detach-heads --mtp-hybrid-override-pattern --mtp-standalone --mtp-use-repeated-layer
non-persistent and local checkpoints:
    --non-persistent-ckpt-type --non-persistent-global-ckpt-dir --non-persistent-local-ckpt-algo
    --non-persistent-local-ckpt-dir --non-persistent-save-interval --replication
    --replication-factor --replication-jump
non-strict (partial) checkpoint loading:
    --disable-strict-fsdp-dtensor-load --no-strict-fsdp-dtensor-load
packed documents beyond --reset-attention-mask (hybrid context parallelism, loader-made masks):
    --dataloader-inter-document-masking --hybrid-context-parallel --max-seqlen-per-dp-cp-rank
parameter groups from a file:
    --dump-param-to-param-group-map
precision switches:
    --disable-bf16-reduced-precision-matmul --fp16-lm-cross-entropy
precision-aware optimizer (low-precision master weights and moments):
    --exp-avg-dtype --exp-avg-sq-dtype --main-grads-dtype --main-params-dtype
    --use-precision-aware-optimizer
process-group timeout after start-up:
    --distributed-timeout-seconds-after-init
profiling options:
    --memory-snapshot-path --nvtx-ranges --pytorch-profiler-collect-callstack
    --pytorch-profiler-collect-chakra --pytorch-profiler-collect-shapes --record-memory-history
    --record-shapes
rerun state machine (result validation):
    --check-for-spiky-loss --error-injection-rate --error-injection-type
    --result-rejected-tracker-filename
residual-connection variants:
    --apply-residual-connection-post-layernorm --fp32-residual-connection
resilience integrations (fault tolerance, restarts, straggler detection, fault injection):
    --adlr-autoresume --adlr-autoresume-interval --calc-ft-timeouts
    --disable-straggler-on-startup --enable-ft-package --fault-injector-delay-start-iteration
    --fault-injector-fault-delay --fault-injector-fault-probabilities
    --fault-injector-fault-types --fault-injector-mtti-seconds --fault-injector-num-ranks
    --fault-injector-offset-seconds --fault-injector-ranks --fault-injector-seed
    --ft-num-warmup-iters --gpu-sniff-test-interval --inprocess-active-world-size
    --inprocess-barrier-timeout --inprocess-completion-timeout --inprocess-empty-cuda-cache
    --inprocess-granularity --inprocess-hard-timeout --inprocess-heartbeat-interval
    --inprocess-heartbeat-timeout --inprocess-last-call-wait --inprocess-max-iterations
    --inprocess-monitor-process-interval --inprocess-monitor-thread-interval
    --inprocess-progress-watchdog-interval --inprocess-restart --inprocess-soft-timeout
    --inprocess-termination-grace-time --run-workload-inspector-server --straggler-ctrlr-port
sequence-chunked MLP (peak memory):
    --mlp-chunks-for-training
slow (Python) Hugging Face tokenizers:
    --tokenizer-hf-no-use-fast
static loss scale:
    --loss-scale
tensor dumps (parameters, activations, gradients):
    --save-activations-interval --save-dgrads-interval --save-params-interval
    --save-tokens-per-expert-interval --save-wgrads-interval
tokenizer options:
    --disable-pad-vocab-size --disable-tokenizer-sentencepiece-ignore-extra-whitespaces
    --no-pad-vocab-size --no-tokenizer-sentencepiece-ignore-extra-whitespaces
    --null-tokenizer-pad-id --padded-vocab-size --tiktoken-special-tokens --tokenizer-metadata
    --tokenizer-sentencepiece-legacy --tokenizer-special-tokens --vocab-extra-ids
torch FSDP2:
    --torch-fsdp2-no-reshard-after-forward --use-torch-fsdp2
training phases:
    --phase-transition-iterations
training-loop checks (NaN, large gradients, weight hashes):
    --check-for-large-grads --no-check-for-nan-in-loss-and-grad
weight-decay schedule and exclusions:
    --apply-wd-to-qk-layernorm --end-weight-decay --no-weight-decay-cond-type
    --start-weight-decay --weight-decay-incr-style
""")

# refused: what the flag is for (not pretraining GPT-style models)
NOT_APPLICABLE = _table("""
BERT and T5 models:
    --bert-embedder-type --bert-load --bert-no-binary-head --decoder-num-layers
    --decoder-seq-length --mask-prob --output-bert-embeddings --relative-attention-max-distance
    --relative-attention-num-buckets --sample-rate --short-seq-prob
ModelOpt (export, quantization, distillation):
    --enable-gpt-oss --export-default-te-spec --export-force-local-attention --export-kd-cfg
    --export-kd-teacher-ckpt-format --export-kd-teacher-load --export-kd-teacher-model-config
    --export-kv-cache-quant --export-legacy-megatron --export-model-type
    --export-moe-apply-probs-on-input --export-offline-model --export-qk-l2-norm
    --export-quant-cfg --export-real-quant-cfg --export-te-mcore-model --finetune-data-split
    --finetune-hf-dataset --freeze-base-for-mtp --modelopt-enabled --qad-train-target
ONNX export:
    --onnx-safe
checkpoint conversion:
    --ckpt-convert-format --ckpt-convert-save --ckpt-convert-update-legacy-dist-opt-format
embedding Megatron-LM in another framework:
    --lazy-mpu-init
inference and text generation:
    --cache-mla-latents --decode-only-cuda-graphs --disable-chunked-prefill
    --enable-chunked-prefill --flash-decode
    --inference-batch-times-seqlen-threshold --inference-coordinator-port
    --inference-cuda-graph-all-prefills --inference-cuda-graph-max-tokens
    --inference-cuda-graph-scope --inference-disable-ep-consensus
    --inference-disable-triton-nvls-kernels --inference-dynamic-batching
    --inference-dynamic-batching-async-sched-mode --inference-dynamic-batching-block-size
    --inference-dynamic-batching-buffer-size-gb
    --inference-dynamic-batching-cuda-graph-max-tokens
    --inference-dynamic-batching-cuda-graph-mixed-prefill-count
    --inference-dynamic-batching-cuda-graph-sizing-distribution
    --inference-dynamic-batching-logprobs-mode --inference-dynamic-batching-mamba-memory-ratio
    --inference-dynamic-batching-max-requests --inference-dynamic-batching-max-tokens
    --inference-dynamic-batching-num-cuda-graphs
    --inference-dynamic-batching-paused-buffer-size-gb
    --inference-dynamic-batching-prefix-caching
    --inference-dynamic-batching-prefix-caching-coordinator-policy
    --inference-dynamic-batching-prefix-caching-eviction-policy
    --inference-dynamic-batching-prefix-caching-mamba-gb
    --inference-dynamic-batching-prefix-caching-routing-alpha
    --inference-dynamic-batching-sampling-backend
    --inference-dynamic-batching-track-generated-token-events
    --inference-dynamic-batching-track-paused-request-events
    --inference-dynamic-batching-unified-memory-level --inference-fuse-tp-communication
    --inference-grouped-gemm-backend --inference-logging-step-interval
    --inference-max-batch-size --inference-max-requests --inference-max-seq-length
    --inference-moe-disable-fused-quant-kernels --inference-moe-token-dispatcher-type
    --inference-rng-tracker --inference-shards --inference-text-gen-server-logging
    --inference-use-synchronous-zmq-collectives --inference-wandb-logging
    --mamba-inference-conv-states-dtype --mamba-inference-ssm-states-dtype --max-tokens-to-oom
    --mlp-chunks-for-prefill --moe-pad-experts-for-cuda-graph-inference
    --nccl-all-reduce-for-prefill --no-inference-disable-ep-consensus
    --no-inference-dynamic-batching-prefix-caching --no-inference-text-gen-server-logging
    --no-inference-use-synchronous-zmq-collectives --no-inference-wandb-logging
    --num-speculative-tokens --use-legacy-static-engine --use-same-sampling-seed-across-dp-ranks
logits distillation:
    --logits-load-decode-threads --logits-load-dir --logits-load-ignore-errors
    --logits-load-kd-loss-alpha --logits-load-msc-prefetch-depth --logits-load-prefetch-factor
    --logits-save-dir --logits-save-dtype --logits-save-top-k --logits-save-top-p
    --logits-save-top-p-min-k
reinforcement learning (GRPO):
    --grpo-clamp-eps-lower --grpo-clamp-eps-upper --grpo-entropy-term-weight
    --grpo-filter-groups-with-same-reward --grpo-group-size --grpo-iterations --grpo-kl-beta
    --grpo-prompts-per-step --langrl-env-config --langrl-external-server
    --langrl-inference-server-conversation-template --langrl-inference-server-type
    --no-langrl-external-server --no-rl-inference-logprobs-is-correction
    --no-rl-offload-inference-model-weights-when-idle --no-rl-offload-kv-cache-during-training
    --no-rl-partial-rollouts --no-rl-persist-cuda-graphs --no-rl-remove-kv-cache-during-training
    --no-rl-reset-cuda-graphs --no-rl-skip-bos-token --no-rl-training-cuda-graphs
    --no-rl-use-sequence-packing --no-rl-verify-model-weights-swap --perform-rl-step
    --refit-method --rl-consumption-granularity --rl-default-temperature --rl-default-top-k
    --rl-default-top-p --rl-generation-lag --rl-importance-sampling-truncation-coef
    --rl-inference-expert-model-parallel-size --rl-inference-expert-tensor-model-parallel-size
    --rl-inference-logprobs-is-correction --rl-inference-model-unified-memory-level
    --rl-inference-parsers --rl-inference-pipeline-model-parallel-size
    --rl-inference-tensor-model-parallel-size --rl-kv-cache-management-mode
    --rl-offload-inference-model-weights-when-idle --rl-offload-kv-cache-during-training
    --rl-offload-optimizer-during-inference --rl-parallel-generation-tasks --rl-partial-rollouts
    --rl-persist-cuda-graphs --rl-profile --rl-profile-dir --rl-prompts-per-eval
    --rl-remove-kv-cache-during-training --rl-reset-cuda-graphs --rl-sequence-packing-algo
    --rl-sequence-packing-max-sequences-per-bin --rl-skip-bos-token --rl-submission-granularity
    --rl-training-cuda-graphs --rl-use-sequence-packing --rl-verify-model-weights-swap
retired Megatron-LM flag (Megatron-LM rejects it too):
    --batch-size --checkpoint-activations --model-parallel-size --warmup
retrieval models (retro, ICT, REALM):
    --biencoder-projection-dim --biencoder-shared-query-context-model --block-data-path
    --embedding-path --evidence-data-path --ict-head-size --ict-load --indexer-batch-size
    --indexer-log-interval --query-in-block-prob --retriever-report-topk-accuracies
    --retriever-score-scaling --titles-data-path --use-one-sent-docs
supervised fine-tuning and chat:
    --chat-template --sft --sft-tokenizer-prompt-format
vision and multimodal models:
    --classes-fraction --data-per-class-fraction --dino-bottleneck-size --dino-freeze-last-layer
    --dino-head-hidden-size --dino-local-crops-number --dino-local-img-size
    --dino-norm-last-layer --dino-teacher-temp --dino-warmup-teacher-temp
    --dino-warmup-teacher-temp-epochs --head-lr-mult --img-h --img-w --iter-per-epoch
    --mask-factor --mask-type --mrope-section --num-channels --num-classes --patch-dim
    --swin-backbone-type --vision-backbone-type --vision-pretraining --vision-pretraining-type
""")
