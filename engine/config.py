"""Typed configuration: dataclasses whose fields carry Megatron-LM's flag names and help.

`engine/arguments.py` generates the command line from these fields. Each config validates
itself once, at start, with messages that say which flag to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass

from engine.batch_schedule import BatchSchedule, parse_step_schedule
from engine.errors import ConfigError
from parallel.pipeline.tables import V_SHAPED


def option(default, help: str, flag: str | None = None, **argparse_kwargs):
    """A dataclass field with command-line metadata (flag defaults to --field-name)."""
    metadata = {"help": help, "flag": flag, **argparse_kwargs}
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


# Flags Megatron-LM requires, except that --use-checkpoint-args takes them from the checkpoint.
FROM_CHECKPOINT = "use_checkpoint_args"


@dataclass
class ModelConfig:
    """The decoder's shape and style (GPT-2 or Llama-like are combinations of these)."""

    num_layers: int = option(2, "number of transformer layers", required=FROM_CHECKPOINT)
    hidden_size: int = option(128, "transformer hidden size", required=FROM_CHECKPOINT)
    num_attention_heads: int = option(4, "number of attention heads", required=FROM_CHECKPOINT)
    group_query_attention: bool = option(
        False, "grouped-query attention, with --num-query-groups key/value head groups"
    )
    num_query_groups: int | None = option(
        None,
        "key/value head groups, read only with --group-query-attention (as in Megatron-LM; "
        "default 1 then); without it every head has its own",
    )
    ffn_hidden_size: int | None = option(
        None, "MLP hidden size (default 4 x hidden; with --swiglu 2/3 of that, rounded to 64)"
    )
    kv_channels: int | None = option(None, "per-head size (default hidden / heads)")
    seq_length: int = option(128, "tokens per training sample", required=FROM_CHECKPOINT)
    max_position_embeddings: int | None = option(
        None,
        "positions the model is built for (the learned position table's size); at least "
        "--seq-length",
        required=FROM_CHECKPOINT,
    )
    vocab_size: int | None = option(
        None,
        "vocabulary size (default: the tokenizer's); NullTokenizer's size, and TikTokenizer's "
        "(default 131072)",
    )
    make_vocab_size_divisible_by: int = option(
        128, "pad the vocabulary to a multiple of this times the tensor-parallel size"
    )
    position_embedding_type: str = option(
        "learned_absolute",
        "position encoding (yarn: RoPE with YaRN scaling, Megatron-LM's spelling)",
        choices=["learned_absolute", "rope", "yarn"],
    )
    rotary_base: int = option(10000, "RoPE base (theta)")
    use_rope_scaling: bool = option(
        False, "Llama 3.x RoPE scaling: low frequencies slowed by --rope-scaling-factor"
    )
    rope_scaling_factor: float = option(8.0, "with --use-rope-scaling: the scaling factor")
    rope_scaling_low_freq_factor: float = option(
        1.0, "with --use-rope-scaling: wavelengths above original length / this are scaled"
    )
    rope_scaling_high_freq_factor: float = option(
        4.0, "with --use-rope-scaling: wavelengths below original length / this are kept"
    )
    rope_scaling_original_max_position_embeddings: int = option(
        8192, "with --use-rope-scaling: the context length the model was first trained at"
    )
    rotary_seq_len_interpolation_factor: float | None = option(
        None, "linear RoPE scaling (position interpolation): positions divided by this"
    )
    rope_scaling_type: str | None = option(
        None,
        "RoPE scaling by Hugging Face's rope_type name, with --rope-scaling-factor (and, for "
        "llama3 and yarn, --rope-scaling-original-max-position-embeddings): llama3 (as "
        "--use-rope-scaling), linear, dynamic (NTK: the base grows with a sequence longer "
        "than --max-position-embeddings), yarn",
        choices=["llama3", "linear", "dynamic", "yarn"],
    )
    rotary_scaling_factor: float = option(
        1.0, "with --position-embedding-type yarn: the YaRN scaling factor"
    )
    yarn_original_max_position_embeddings: int | None = option(
        None, "with --position-embedding-type yarn: the length first trained at (default 4096)"
    )
    yarn_beta_fast: float | None = option(None, "YaRN: rotations where extrapolation ends (32)")
    yarn_beta_slow: float | None = option(None, "YaRN: rotations where interpolation starts (1)")
    mscale: float = option(1.0, "YaRN: the attention scale's log(factor) coefficient / 0.1")
    mscale_all_dim: float = option(0.0, "YaRN: the same for its denominator (0: none)")
    yarn_correction_range_round_to_int: bool = option(
        True,
        "YaRN: keep the correction range's ends unrounded",
        flag="--no-yarn-correction-range-round-to-int",
        action="store_false",
    )
    rotary_percent: float = option(
        1.0, "the share of each head's channels RoPE rotates (the first ones); the rest pass"
    )
    normalization: str = option("LayerNorm", "norm type", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = option(1e-5, "epsilon of the norms")
    apply_layernorm_1p: bool = option(
        False,
        "norm weights stored centred on zero (initialised to 0) and applied as 1 + weight; "
        "exported to Hugging Face as 1 + weight",
    )
    swiglu: bool = option(False, "SwiGLU MLP instead of GELU")
    openai_gelu: bool = option(False, "GELU's tanh approximation, as OpenAI's GPT-2 uses")
    add_bias_linear: bool = option(
        True, "no biases in linear layers", flag="--disable-bias-linear", action="store_false"
    )
    untie_embeddings_and_output_weights: bool = option(
        False, "separate output layer instead of reusing the input embedding"
    )
    qk_layernorm: bool = option(False, "normalise queries and keys per head")
    window_size: str | None = option(
        None,
        "sliding-window attention, as Megatron-LM's (left, right): each token attends to "
        "itself and the `left` tokens before it (right must be 0: causal); default: all",
    )
    add_qkv_bias: bool = option(
        False,
        "biases on the query, key and value projections only (Qwen2), with or without "
        "--disable-bias-linear",
    )
    hidden_dropout: float = option(0.1, "dropout on the residual branches and embeddings")
    attention_dropout: float = option(0.1, "dropout on the attention probabilities")
    init_method_std: float = option(0.02, "std of the normal weight initialisation")
    recompute_granularity: str | None = option(
        None, "activation recomputation", choices=["full", "selective"]
    )
    recompute_method: str | None = option(
        None,
        "with full recomputation: uniform chunks or the first N layers",
        choices=["uniform", "block"],
    )
    recompute_num_layers: int | None = option(
        None, "layers per recomputed chunk (uniform) or layers recomputed per stage (block)"
    )
    z_loss_coeff: float = option(
        0.0, "add this times logsumexp(logits)^2 to the loss (keeps logits from drifting)"
    )

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.query_groups

    @property
    def query_groups(self) -> int:
        if not self.group_query_attention:
            return self.num_attention_heads
        return self.num_query_groups or 1

    @classmethod
    def from_record(cls, record: dict) -> ModelConfig:
        """The config saved in a checkpoint's meta.json (checkpoints written before
        --group-query-attention existed applied --num-query-groups alone)."""
        record = dict(record)
        record.setdefault("group_query_attention", record.get("num_query_groups") is not None)
        return cls(**record)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.swiglu:
            return int(4 * self.hidden_size * 2 / 3 / 64) * 64 or 4 * self.hidden_size
        return 4 * self.hidden_size

    @property
    def attention_window(self) -> int | None:
        """With --window-size: how many tokens before each one it attends to (None: all)."""
        if not self.window_size:
            return None
        try:
            left, right = (int(v) for v in str(self.window_size).strip("() ").split(","))
        except ValueError:
            raise ConfigError(
                f"--window-size {self.window_size}: give two integers, (left, right), e.g. "
                "'(4095, 0)'"
            ) from None
        if right != 0 or left < -1:
            raise ConfigError(
                f"--window-size {self.window_size}: only causal windows (right 0) with left >= 0 "
                "(or -1: no window) are available"
            )
        return None if left == -1 else left

    @property
    def rotary_dim(self) -> int:
        """Channels of a head that RoPE rotates (as Megatron-LM: int(head size x percent))."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def uses_rope(self) -> bool:
        """Rotary positions (rope, or yarn: RoPE with YaRN scaling)."""
        return self.position_embedding_type in ("rope", "yarn")

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    def padded_vocab_size(self, tp: int) -> int:
        if self.vocab_size is None:
            raise ConfigError("the vocabulary size is unknown; give a tokenizer or --vocab-size")
        multiple = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def validate(self, tp: int = 1, sequence_parallel: bool = False) -> None:
        """Raise ConfigError naming the flag to change for any impossible shape."""
        h, n, g = self.hidden_size, self.num_attention_heads, self.query_groups
        positive = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.kv_channels is None and h % n:
            raise ConfigError(
                f"hidden-size {h} is not divisible by num-attention-heads {n}; change one of "
                "them or set --kv-channels"
            )
        if n % tp:
            raise ConfigError(
                f"num-attention-heads {n} is not divisible by tensor-model-parallel-size {tp}"
            )
        if self.num_query_groups is not None and self.num_query_groups < 1:
            raise ConfigError("--num-query-groups must be at least 1")
        if n % g:
            raise ConfigError(f"num-attention-heads {n} is not divisible by num-query-groups {g}")
        if g % tp:
            raise ConfigError(
                f"num-query-groups {g} is not divisible by tensor-model-parallel-size {tp}"
            )
        if self.ffn_size % tp:
            raise ConfigError(
                f"ffn-hidden-size {self.ffn_size} is not divisible by "
                f"tensor-model-parallel-size {tp}"
            )
        if sequence_parallel and self.seq_length % tp:
            raise ConfigError(
                f"seq-length {self.seq_length} is not divisible by tensor-model-parallel-size "
                f"{tp}, which --sequence-parallel needs"
            )
        from engine.model.rope import rope_scaling_of  # the one reading of the scaling flags

        scaling = rope_scaling_of(self)
        dynamic = scaling is not None and scaling["rope_type"] == "dynamic"
        if self.max_positions < self.seq_length and not dynamic:
            raise ConfigError(
                f"max-position-embeddings {self.max_positions} < seq-length {self.seq_length}"
            )
        _ = self.attention_window  # --window-size parses
        scaled = self.use_rope_scaling or self.rotary_seq_len_interpolation_factor
        if (scaled or self.rope_scaling_type) and not self.uses_rope:
            raise ConfigError(
                "--use-rope-scaling, --rotary-seq-len-interpolation-factor and "
                "--rope-scaling-type scale RoPE; add --position-embedding-type rope"
            )
        if self.use_rope_scaling and (
            self.rope_scaling_factor < 1
            or not 0 < self.rope_scaling_low_freq_factor < self.rope_scaling_high_freq_factor
        ):
            raise ConfigError(
                "--use-rope-scaling needs --rope-scaling-factor >= 1 and 0 < "
                "--rope-scaling-low-freq-factor < --rope-scaling-high-freq-factor"
            )
        if (self.rotary_seq_len_interpolation_factor or 1) < 1:
            raise ConfigError("--rotary-seq-len-interpolation-factor must be at least 1")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ConfigError(f"--rotary-percent {self.rotary_percent} must be in (0, 1]")
        if self.uses_rope and (self.rotary_dim < 2 or self.rotary_dim % 2):
            raise ConfigError(
                f"RoPE needs an even number of rotated channels per head, got {self.rotary_dim} "
                f"(head size {self.head_dim} x --rotary-percent {self.rotary_percent})"
            )
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"--{name.replace('_', '-')} must be in [0, 1)")
        if self.recompute_granularity == "full":
            if self.recompute_method is None or not self.recompute_num_layers:
                raise ConfigError(
                    "--recompute-granularity full needs --recompute-method uniform|block and "
                    "--recompute-num-layers N"
                )
        elif self.recompute_method is not None:
            raise ConfigError("--recompute-method needs --recompute-granularity full")
        if self.make_vocab_size_divisible_by < 1:
            raise ConfigError("--make-vocab-size-divisible-by must be at least 1")


@dataclass
class OptimizerConfig:
    """Optimizer, learning-rate schedule, clipping and loss scaling."""

    optimizer: str = option(
        "adam", "optimizer (AdamW-style decoupled decay)", choices=["adam", "sgd"]
    )
    lr: float = option(3e-4, "peak learning rate")
    min_lr: float = option(0.0, "learning rate at the end of the decay")
    decoupled_lr: float | None = option(
        None,
        "peak learning rate of the word embeddings and the output layer (default --lr); the "
        "same warm-up and decay",
    )
    decoupled_min_lr: float | None = option(
        None, "with --decoupled-lr: their learning rate at the end of the decay (default --min-lr)"
    )
    lr_decay_style: str = option(
        "linear",
        "decay after warm-up",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
    )
    lr_decay_iters: int | None = option(
        None,
        "iterations to decay the learning rate over, warm-up included (default: --train-iters)",
    )
    lr_decay_samples: int | None = option(
        None, "with --train-samples: samples to decay over (default: --train-samples)"
    )
    lr_warmup_iters: int = option(0, "iterations of linear warm-up from --lr-warmup-init")
    lr_warmup_samples: int = option(0, "with --train-samples: samples of linear warm-up")
    lr_warmup_fraction: float | None = option(
        None, "warm-up as this fraction of the decay length (instead of --lr-warmup-iters/samples)"
    )
    lr_warmup_init: float = option(0.0, "learning rate of the first warm-up update")
    lr_wsd_decay_style: str = option(
        "exponential",
        "WSD: shape of the final decay",
        choices=["exponential", "linear", "cosine", "minus_sqrt"],
    )
    lr_wsd_decay_iters: int | None = option(None, "WSD: iterations of the final decay")
    lr_wsd_decay_samples: int | None = option(
        None, "WSD with --train-samples: samples of the final decay"
    )
    weight_decay: float = option(0.01, "decoupled weight decay (not on biases and norms)")
    adam_beta1: float = option(0.9, "Adam beta1")
    adam_beta2: float = option(0.999, "Adam beta2")
    adam_eps: float = option(1e-8, "Adam epsilon")
    sgd_momentum: float = option(0.9, "SGD momentum")
    clip_grad: float = option(1.0, "clip the global gradient norm to this (0: off)")
    apex_fused_adam: bool = option(False, "use apex's FusedAdam (needs apex importable)")
    initial_loss_scale: float = option(2.0**32, "fp16: initial dynamic loss scale")
    min_loss_scale: float = option(1.0, "fp16: the loss scale never goes below this")
    loss_scale_window: int = option(1000, "fp16: clean steps before the scale doubles")
    hysteresis: int = option(2, "fp16: overflowing steps in a row before the scale halves")

    def schedule_samples(
        self, train_iters: int | None, train_samples: int | None = None, global_batch: int = 1
    ) -> tuple[float, int, int | None]:
        """(warm-up, decay, WSD anneal) lengths in samples, as Megatron-LM derives them: from
        the iteration flags times the global batch when training by iterations, from the
        sample flags when training by --train-samples; --lr-warmup-fraction takes that share of
        the decay length (so the warm-up may be a fraction of a sample)."""
        if train_samples:
            decay = self.lr_decay_samples if self.lr_decay_samples is not None else train_samples
            wsd = self.lr_wsd_decay_samples
            warmup = self.lr_warmup_samples
        else:
            decay_iters = self.lr_decay_iters if self.lr_decay_iters is not None else train_iters
            decay = (decay_iters or 0) * global_batch
            wsd = (
                None if self.lr_wsd_decay_iters is None else self.lr_wsd_decay_iters * global_batch
            )
            warmup = self.lr_warmup_iters * global_batch
        if self.lr_warmup_fraction is not None:
            warmup = self.lr_warmup_fraction * decay
        return warmup, decay, wsd

    def validate(
        self, train_iters: int | None = None, train_samples: int | None = None, global_batch=1
    ) -> None:
        # The bounds megatron.core's OptimizerParamScheduler and Megatron-LM's argument checks
        # assert, as flag errors.
        by_samples = bool(train_samples)
        unit, other = ("samples", "iters") if by_samples else ("iters", "samples")
        wrong = {
            "iters": (self.lr_decay_iters, self.lr_warmup_iters or None, self.lr_wsd_decay_iters),
            "samples": (
                self.lr_decay_samples,
                self.lr_warmup_samples or None,
                self.lr_wsd_decay_samples,
            ),
        }[other]
        for name, value in zip(("decay", "warmup", "wsd-decay"), wrong):
            if value is not None:
                raise ConfigError(
                    f"--lr-{name}-{other} goes with --train-{other}, but the run is counted in "
                    f"{unit} (--train-{unit}); use --lr-{name}-{unit}"
                )
        if self.lr_warmup_fraction is not None and (self.lr_warmup_iters or self.lr_warmup_samples):
            raise ConfigError(
                "--lr-warmup-fraction and --lr-warmup-iters/samples both set the warm-up; give one"
            )
        if self.lr_warmup_fraction is not None and not 0 <= self.lr_warmup_fraction < 1:
            raise ConfigError("--lr-warmup-fraction must be in [0, 1)")
        for name in ("lr_decay_iters", "lr_decay_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.lr_warmup_iters < 0 or self.lr_warmup_samples < 0:
            raise ConfigError(f"--lr-warmup-{unit} must be non-negative")
        warmup, decay, _ = self.schedule_samples(train_iters, train_samples, global_batch)
        if (train_iters or train_samples) and warmup >= decay:
            if self.lr_warmup_fraction is not None:
                given = f"--lr-warmup-fraction {self.lr_warmup_fraction}"
            else:
                given = f"--lr-warmup-{unit} {getattr(self, f'lr_warmup_{unit}')}"
            raise ConfigError(
                f"the warm-up ({given}) must be shorter than the decay length (--lr-decay-{unit}, "
                f"default --train-{unit}); lower it or raise the decay length"
            )
        if self.lr < 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"need 0 <= --min-lr ({self.min_lr}) <= --lr ({self.lr})")
        if self.decoupled_min_lr is not None and self.decoupled_lr is None:
            raise ConfigError("--decoupled-min-lr goes with --decoupled-lr; give both or neither")
        if self.decoupled_lr is not None:
            floor = self.min_lr if self.decoupled_min_lr is None else self.decoupled_min_lr
            if self.decoupled_lr < 0 or floor < 0 or floor > self.decoupled_lr:
                raise ConfigError(
                    f"need 0 <= --decoupled-min-lr (default --min-lr; {floor}) <= --decoupled-lr "
                    f"({self.decoupled_lr})"
                )
        if not 0 <= self.lr_warmup_init <= self.lr:
            raise ConfigError(f"need 0 <= --lr-warmup-init ({self.lr_warmup_init}) <= --lr")
        if self.clip_grad < 0:
            raise ConfigError("--clip-grad must be non-negative (0 turns clipping off)")
        wsd = self.lr_wsd_decay_samples if by_samples else self.lr_wsd_decay_iters
        if self.lr_decay_style == "WSD" and (wsd or 0) < 1:
            raise ConfigError(f"--lr-decay-style WSD needs --lr-wsd-decay-{unit} (at least 1)")


@dataclass
class ParallelConfig:
    """How the model and the data are split over processes."""

    tensor_model_parallel_size: int = option(1, "tensor-parallel size (TP)")
    pipeline_model_parallel_size: int = option(1, "pipeline-parallel size (PP)")
    num_layers_per_virtual_pipeline_stage: int | None = option(
        None, "layers per virtual stage: interleaved 1F1B with num_layers / (PP x this) chunks"
    )
    decoder_first_pipeline_num_layers: int | None = option(
        None, "layers on the first pipeline stage (the rest split evenly)"
    )
    decoder_last_pipeline_num_layers: int | None = option(
        None, "layers on the last pipeline stage (the rest split evenly)"
    )
    pipeline_schedule: str | None = option(
        None,
        "force a schedule (default: 1F1B, interleaved with virtual stages): gpipe, 1f1b, "
        "interleaved, zb-h1 (zero bubble, 1F1B's memory), zb-v (zero bubble, 2 chunks per "
        "rank in a V), dualpipe-v (DeepSeek's DualPipe in a V)",
        choices=["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v"],
    )
    overlap_p2p_communication: bool = option(
        False, "interleaved schedule: pipeline transfers run during compute"
    )
    sequence_parallel: bool = option(False, "split norms/dropout/residuals along the sequence")
    context_parallel_size: int = option(
        1, "context-parallel size (CP): each sample's sequence is split over this many ranks"
    )
    cp_comm_type: list[str] = option(
        ["p2p"],
        "how CP attention exchanges keys and values: p2p (ring), a2a (all-to-all over heads), "
        "allgather (a2a+p2p is refused); one value, or one per layer",
        nargs="+",
        choices=["p2p", "a2a", "allgather", "a2a+p2p"],
    )
    gradient_accumulation_fusion: bool = option(
        True,
        "linear layers add their weight gradients straight into the fp32 main_grad buffer, "
        "with no .grad per micro-batch",
        flag="--no-gradient-accumulation-fusion",
        action="store_false",
    )
    use_distributed_optimizer: bool = option(False, "shard optimizer state over DP (ZeRO)")
    use_megatron_fsdp: bool = option(
        False,
        "fully sharded data parallelism with --data-parallel-sharding-strategy (implies "
        "--use-distributed-optimizer)",
    )
    data_parallel_sharding_strategy: str | None = option(
        None,
        "with --use-megatron-fsdp, what DP ranks shard (default optim_grads_params): "
        "optimizer state (optim), also gradients (optim_grads), also parameters; without "
        "it no effect (as in Megatron-LM)",
        choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
    )
    overlap_grad_reduce: bool = option(False, "reduce gradient buckets during backward")
    overlap_param_gather: bool = option(
        False, "with the distributed optimizer: gather parameters during the next forward"
    )
    ddp_bucket_size: int | None = option(None, "elements per gradient bucket")
    distributed_timeout_minutes: float = option(
        10.0, "a collective waiting longer than this fails the run (e.g. a dead rank)"
    )

    def sharding_strategy(self) -> str:
        """What DP ranks shard (parallel/ddp.py): Megatron-LM's strategy names."""
        if self.use_megatron_fsdp:
            return self.data_parallel_sharding_strategy or "optim_grads_params"
        return "optim" if self.use_distributed_optimizer else "no_shard"

    def shards_optimizer(self) -> bool:
        return self.sharding_strategy() != "no_shard"

    def virtual_size(self, num_layers: int) -> int:
        if not self.num_layers_per_virtual_pipeline_stage:
            return 1
        per_stage = num_layers // self.pipeline_model_parallel_size
        return per_stage // self.num_layers_per_virtual_pipeline_stage

    def validate(self, num_layers: int) -> None:
        pp = self.pipeline_model_parallel_size
        layers_per_virtual = self.num_layers_per_virtual_pipeline_stage
        if layers_per_virtual:
            if pp < 2:
                raise ConfigError(
                    "--num-layers-per-virtual-pipeline-stage needs "
                    "--pipeline-model-parallel-size of 2 or more"
                )
            if num_layers % (pp * layers_per_virtual):
                raise ConfigError(
                    f"num-layers {num_layers} is not divisible by pipeline-model-parallel-size "
                    f"{pp} x num-layers-per-virtual-pipeline-stage {layers_per_virtual}"
                )
            if self.virtual_size(num_layers) < 2:
                raise ConfigError(
                    f"--num-layers-per-virtual-pipeline-stage {layers_per_virtual} leaves one "
                    f"chunk per stage; use fewer layers per virtual stage or drop the flag"
                )
        if self.pipeline_schedule == "interleaved" and not layers_per_virtual:
            raise ConfigError(
                "--pipeline-schedule interleaved needs --num-layers-per-virtual-pipeline-stage"
            )
        if self.pipeline_schedule in ("gpipe", "1f1b", "zb-h1") and layers_per_virtual:
            raise ConfigError(
                f"--pipeline-schedule {self.pipeline_schedule} cannot run virtual stages; "
                "drop --num-layers-per-virtual-pipeline-stage"
            )
        if self.pipeline_schedule in V_SHAPED and self.virtual_size(num_layers) != 2:
            raise ConfigError(
                f"--pipeline-schedule {self.pipeline_schedule} runs 2 model chunks per rank: set "
                "--num-layers-per-virtual-pipeline-stage to num-layers / (2 x "
                "pipeline-model-parallel-size)"
            )
        if self.overlap_p2p_communication and not layers_per_virtual:
            raise ConfigError(
                "--overlap-p2p-communication runs with the interleaved schedule only; add "
                "--num-layers-per-virtual-pipeline-stage or drop the flag"
            )
        if self.overlap_param_gather and not self.shards_optimizer():
            # with optim_grads_params the gathers always run ahead of the forward (prefetch)
            raise ConfigError(
                "--overlap-param-gather needs --use-distributed-optimizer (with "
                "--use-megatron-fsdp: a --data-parallel-sharding-strategy other than no_shard)"
            )
        if (
            self.decoder_first_pipeline_num_layers or self.decoder_last_pipeline_num_layers
        ) and pp < 2:
            raise ConfigError(
                "--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size >= 2"
            )
        if self.distributed_timeout_minutes <= 0:
            raise ConfigError("--distributed-timeout-minutes must be positive")


@dataclass
class DataConfig:
    """Where training data comes from and how it is cut into samples."""

    data_path: list[str] = option(
        [],
        "dataset prefix, weight/prefix pairs to blend (0.7 A 0.3 B), or prefixes alone to blend "
        "one epoch of each, weighted by size (A B)",
    )
    split: str = option("969,30,1", "train/valid/test proportions, by sequences (documents)")
    train_data_path: list[str] = option(
        [], "the train split's own paths, as --data-path (instead of --data-path and --split)"
    )
    valid_data_path: list[str] = option(
        [], "the valid split's own paths, as --data-path (instead of --data-path and --split)"
    )
    test_data_path: list[str] = option(
        [], "the test split's own paths, as --data-path (instead of --data-path and --split)"
    )
    data_args_path: str | None = option(
        None, "a file holding the --data-path list (whitespace-separated), for long blends"
    )
    data_mix_schedule: str | None = option(
        None,
        "a JSON or YAML file of blend weights over training: phases starting at a fraction of "
        "the training samples (at: 0.8) or an iteration, weights by --data-path's dataset names",
    )
    per_split_data_args_path: str | None = option(
        None,
        'a JSON file with the train/valid/test split\'s paths ({"train": [...], "valid": '
        '..., "test": ...}; lists or whitespace-separated strings)',
    )
    mock_data: bool = option(
        False,
        "train on generated documents (Megatron-LM's mock data) instead of --data-path, to try "
        "a launch with no data",
    )
    data_cache_path: str | None = option(
        None, "where dataset index caches go (default: a cache/ folder beside the data)"
    )
    num_workers: int = option(
        2, "data-loader worker processes per rank (with Parquet: per --data-path source)"
    )
    data_format: str | None = option(
        None,
        "what --data-path names: preprocessed .bin/.idx prefixes (indexed) or Parquet files and "
        "folders streamed and tokenized on the fly (parquet); default: detected from the paths",
        choices=["indexed", "parquet"],
    )
    parquet_text_column: str = option("text", "the Parquet column that holds the documents")
    parquet_shuffle_buffer: int = option(
        4096,
        "Parquet streaming: rows read, tokenized, packed and shuffled together (the bounded "
        "shuffle buffer, in documents)",
    )

    @property
    def per_split_paths(self) -> tuple[list[str], list[str], list[str]] | None:
        """(train, valid, test) paths when given split by split, else None."""
        paths = (self.train_data_path, self.valid_data_path, self.test_data_path)
        return paths if any(paths) else None

    def read_path_files(self) -> None:
        """--data-args-path and --per-split-data-args-path into the path lists (as Megatron-LM
        reads them); ConfigError (one line) for a file that cannot be used."""
        if self.data_args_path:
            if self.data_path:
                raise ConfigError("--data-args-path and --data-path both name the data; give one")
            self.data_path = _read_text(self.data_args_path, "--data-args-path").split()
            self.data_args_path = None
        if self.per_split_data_args_path:
            flag = "--per-split-data-args-path"
            if self.train_data_path or self.valid_data_path or self.test_data_path:
                raise ConfigError(
                    f"{flag} and --train/valid/test-data-path both name the data; give one"
                )
            try:
                splits = json.loads(_read_text(self.per_split_data_args_path, flag))
            except json.JSONDecodeError as err:
                raise ConfigError(
                    f"{flag} {self.per_split_data_args_path}: not JSON ({err}); write "
                    '{"train": [...], "valid": [...], "test": [...]}'
                ) from None
            if not isinstance(splits, dict):
                raise ConfigError(f"{flag} {self.per_split_data_args_path}: not a JSON object")
            for name in ("train", "valid", "test"):
                value = splits.get(name) or []
                value = value.split() if isinstance(value, str) else value
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise ConfigError(
                        f"{flag} {self.per_split_data_args_path}: {name!r} must be a list of "
                        "strings or one string"
                    )
                setattr(self, f"{name}_data_path", value)
            self.per_split_data_args_path = None

    def validate(self) -> None:
        self.read_path_files()
        if self.per_split_paths and self.data_path:
            raise ConfigError(
                "--data-path and --train/valid/test-data-path name the data twice; give "
                "--data-path (cut by --split) or the per-split paths"
            )
        if self.per_split_paths and not self.train_data_path:
            raise ConfigError("--valid/test-data-path need --train-data-path too")


@dataclass
class TrainConfig:
    """The training loop: batch sizes, length, precision, evaluation, logging, checkpoints."""

    micro_batch_size: int = option(
        4, "samples per micro-batch per data-parallel rank", required=True
    )
    global_batch_size: int | None = option(
        None, "samples per optimizer step (default: micro-batch x data-parallel size)"
    )
    rampup_batch_size: list[int] | None = option(
        None,
        "START INCREMENT SAMPLES: begin with global batch START and grow it by INCREMENT in "
        "equal intervals over the first SAMPLES samples up to --global-batch-size (with "
        "--train-samples)",
        nargs=3,
        metavar=("START", "INCREMENT", "SAMPLES"),
    )
    step_batch_size_schedule: list[str] | None = option(
        None,
        'global batch by tokens consumed: "0:16 2.4B:320 ..." (K/M/B/T suffixes; one quoted '
        "argument or several, as a script's word splitting passes it); the last batch is the "
        "--global-batch-size",
        nargs="+",
    )
    train_iters: int | None = option(None, "optimizer steps to train for (or --train-samples)")
    train_samples: int | None = option(
        None, "samples to train for (instead of --train-iters): global-batch steps that fit"
    )
    seed: int = option(1234, "random seed (initialisation, data order, dropout)")
    bf16: bool = option(False, "bf16 parameters and activations, fp32 master weights and grads")
    fp16: bool = option(False, "fp16 with dynamic loss scaling, fp32 master weights and grads")
    tf32: bool = option(
        True,
        "on GPUs, fp32 matmuls run on TF32 tensor cores (torch's 'high' float32 matmul "
        "precision); --no-tf32 keeps them in full fp32",
        flag="--no-tf32",
        action="store_false",
    )
    torch_compile: bool = option(
        False,
        "compile each transformer layer's forward with torch.compile (off by default until "
        "measured on a GPU)",
    )
    grad_reduce_in_bf16: bool = option(
        False,
        "with --bf16: accumulate and reduce gradients in bf16 (half the traffic; default fp32); "
        "the update still runs in fp32",
    )
    eval_interval: int | None = option(
        None, "evaluate on the valid split every this many steps (default: only at the end)"
    )
    eval_iters: int = option(100, "global batches per evaluation")
    eval_prompts: str | None = option(
        None,
        "a text file of prompts, one a line: at each evaluation of the valid split, print and "
        "log a greedy and a sampled continuation of each (under the run's own layout)",
    )
    eval_max_new_tokens: int = option(32, "--eval-prompts: tokens generated per continuation")
    eval_temperature: float = option(0.8, "--eval-prompts: the sampled continuation's temperature")
    eval_top_p: float = option(0.95, "--eval-prompts: the sampled continuation's nucleus mass")
    log_interval: int = option(100, "steps between log lines")
    timing_log_level: int = option(
        0,
        "the time breakdown (time/* in the log) is always measured; from 1 on, the device is "
        "synchronised around each measured part so that GPU work is counted where it runs "
        "(adds synchronisations); 2 also times each tensor-parallel collective on a GPU "
        "(tp-comm, timed on CPU at any level; never under --torch-compile), giving up its "
        "overlap with the GEMMs",
        choices=(0, 1, 2),
    )
    log_gradient_noise_scale: bool = option(
        False,
        "log the gradient noise scale (McCandlish et al.'s B_simple, from each DP rank's own "
        "gradient norm and the reduced one, smoothed); needs DP >= 2",
    )
    log_grad_norms_interval: int | None = option(
        None,
        "every this many iterations, log the gradient norm of each layer, the embeddings, the "
        "final norm, the output layer and each optimizer parameter group",
    )
    log_jsonl: str | None = option(None, "append one JSON object per log line to this file")
    tensorboard_dir: str | None = option(None, "write TensorBoard scalars here")
    wandb_project: str | None = option(
        None,
        "log to this Weights & Biases project (needs wandb installed; WANDB_MODE=offline "
        "works without network)",
    )
    wandb_exp_name: str | None = option(None, "the wandb run's name")
    wandb_save_dir: str | None = option(None, "where wandb writes the run (default <--save>/wandb)")
    wandb_entity: str | None = option(None, "the wandb team or user to log under")
    save: str | None = option(None, "checkpoint directory to save to")
    load: str | None = option(None, "checkpoint directory to resume from (its latest)")
    verify_checkpoint: bool = option(
        True,
        "load --load's checkpoint without comparing its files with the checksums recorded when "
        "they were written (sizes are still checked)",
        flag="--no-verify",
        action="store_false",
    )
    finetune: bool = option(
        False,
        "load only the model weights of --load: iteration, samples, optimizer, learning-rate "
        "schedule, data position and random state start afresh",
    )
    no_load_optim: bool = option(
        False,
        "resume without the optimizer state, loss scaler and learning-rate schedule (they "
        "start afresh, as in Megatron-LM); iteration and data position are kept",
    )
    no_load_rng: bool = option(False, "resume without the saved random state (re-seeded)")
    use_checkpoint_args: bool = option(
        False, "take the model's shape and style from the --load checkpoint, not the flags"
    )
    save_interval: int | None = option(None, "steps between checkpoints")
    keep_last_n: int | None = option(None, "keep only the newest N checkpoints")
    async_save: bool = option(False, "write checkpoints in the background")
    exit_on_nan_count: int | None = option(
        None, "stop after this many steps with a NaN/Inf loss or gradient"
    )
    spike_zscore: float = option(6.0, "a loss this many std devs above the recent mean is a spike")
    spike_window: int = option(50, "steps of loss history for spike detection")
    skip_spike_batches: bool = option(False, "skip the update of a step whose loss spikes")
    exit_interval: int | None = option(None, "stop (after saving) when iteration % this == 0")
    exit_duration_in_mins: float | None = option(
        None,
        "stop (after saving) once the processes have run this many minutes; exit code 0 "
        "(0: no limit)",
    )
    exit_signal_handler: bool = option(
        False,
        "on SIGTERM (a preempted or time-limited Slurm job): finish the iteration, save, exit "
        "with code 0",
    )
    profile: bool = option(
        False,
        "profile iterations --profile-step-start to --profile-step-end: the CUDA profiler's "
        "capture range for nsys on a GPU, torch.profiler with --use-pytorch-profiler or on a "
        "CPU (a trace beside --tensorboard-dir)",
    )
    profile_step_start: int = option(10, "--profile: the iteration profiling starts at")
    profile_step_end: int = option(12, "--profile: the iteration profiling stops at")
    profile_ranks: list[int] = option([], "--profile: the ranks profiled (default: all)", nargs="*")
    use_pytorch_profiler: bool = option(
        False, "--profile with torch.profiler (a Chrome trace) also on a GPU"
    )
    device: str | None = option(None, "cpu or cuda (default: cuda when available)")
    use_fused_kernels: bool | None = option(
        None,
        "fused CUDA kernels for norms, RoPE, SwiGLU and cross-entropy (default: on CUDA "
        "when they build; never on CPU)",
        action=argparse.BooleanOptionalAction,
    )
    transformer_impl: str = option(
        "local", "layer implementation", choices=["local", "transformer_engine"]
    )

    def validate(self) -> None:
        if self.bf16 and self.fp16:
            raise ConfigError("--bf16 and --fp16 contradict each other; pick one")
        if self.log_grad_norms_interval is not None and self.log_grad_norms_interval < 1:
            raise ConfigError("--log-grad-norms-interval must be positive (or left out)")
        if self.eval_max_new_tokens < 1 or self.eval_temperature <= 0:
            raise ConfigError("--eval-max-new-tokens must be >= 1 and --eval-temperature > 0")
        if not 0 < self.eval_top_p <= 1:
            raise ConfigError(f"--eval-top-p {self.eval_top_p} must be in (0, 1]")
        for name in ("micro_batch_size", "train_iters", "train_samples", "log_interval"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.eval_interval is not None and self.eval_interval < 1:
            raise ConfigError("--eval-interval must be at least 1")
        if self.save_interval is not None and self.save_interval < 1:
            raise ConfigError("--save-interval must be at least 1")
        if self.save_interval and not self.save:
            raise ConfigError("--save-interval needs --save DIR")
        if self.keep_last_n is not None and self.keep_last_n < 1:
            raise ConfigError("--keep-last-n must be at least 1")
        if self.eval_iters < 0:
            raise ConfigError("--eval-iters must be non-negative")

    def batch_schedule(self, dp: int, seq_length: int) -> BatchSchedule:
        """The global batch over the run (constant, ramped up, or by a step schedule)."""
        return BatchSchedule.from_config(self, dp, seq_length)

    def resolve_length(self, dp: int, seq_length: int) -> None:
        """Sets --train-iters from --train-samples (the steps that fit, as Megatron-LM counts
        them); ConfigError if the length is missing or contradictory."""
        schedule = self.batch_schedule(dp, seq_length)
        if self.train_samples is None:
            if self.train_iters is None:
                raise ConfigError(
                    "the length of training is missing: give --train-iters N or --train-samples N"
                )
            if self.rampup_batch_size is not None:
                raise ConfigError(
                    "--rampup-batch-size needs a run counted in samples (as in Megatron-LM): "
                    "give --train-samples instead of --train-iters"
                )
            return
        iters = schedule.iterations_for_samples(self.train_samples)
        if self.train_iters is not None and self.train_iters != iters:
            raise ConfigError(
                "--train-iters and --train-samples both give the length of training; give one"
            )
        if iters < 1:
            raise ConfigError(
                f"--train-samples {self.train_samples} is less than one global batch "
                f"({schedule.at(0)})"
            )
        self.train_iters = iters

    def num_microbatches(self, dp: int, global_batch: int | None = None) -> int:
        """Micro-batches per step per DP rank (of the final global batch unless one is given);
        ConfigError if the global batch does not split."""
        global_batch = global_batch or self.global_batch(dp)
        if global_batch % (self.micro_batch_size * dp):
            raise ConfigError(
                f"global batch {global_batch} is not divisible by micro-batch-size "
                f"{self.micro_batch_size} x data-parallel size {dp}"
            )
        return global_batch // (self.micro_batch_size * dp)

    def global_batch(self, dp: int) -> int:
        """The global batch after any ramp-up or step schedule (--global-batch-size)."""
        if self.global_batch_size:
            return self.global_batch_size
        if self.step_batch_size_schedule is not None:
            return parse_step_schedule(self.step_batch_size_schedule, 1)[-1][1]
        return self.micro_batch_size * dp


def _read_text(path: str, flag: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise ConfigError(f"{flag} {path}: cannot be read ({reason})") from None
