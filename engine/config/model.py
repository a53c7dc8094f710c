"""The model's shape and style (`ModelConfig`), validated against the tensor-parallel size."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.config.fields import FROM_CHECKPOINT, option
from engine.config.latent_attention import LatentAttentionOptions
from engine.config.moe import MoEOptions, layer_interval, listed_layers
from engine.config.multi_token import MultiTokenOptions
from engine.config.positions import PositionOptions
from engine.config.rope_scaling import rope_scaling_of
from engine.errors import ConfigError

# --recompute-modules' choices (megatron-core's)
RECOMPUTE_MODULES = (
    "core_attn",
    "moe_act",
    "layernorm",
    "mla_up_proj",
    "mlp",
    "moe",
    "shared_experts",
)

# Fields that define the model's tensors; --use-checkpoint-args takes them from the checkpoint.
ARCHITECTURE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "group_query_attention",
    "num_query_groups",
    "ffn_hidden_size",
    "kv_channels",
    "max_position_embeddings",
    "vocab_size",
    "position_embedding_type",
    "rotary_base",
    "normalization",
    "norm_epsilon",
    "apply_layernorm_1p",
    "swiglu",
    "openai_gelu",
    "bias_gelu_fusion",
    "squared_relu",
    "quick_geglu",
    "glu_linear_offset",
    "activation_func_clamp_value",
    "softmax_type",
    "rotary_interleaved",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
    "qk_layernorm",
    "qk_layernorm_across_heads",
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "rope_type",
    "mtp_num_layers",
    "rotary_scaling_factor",
    "mscale",
    "mscale_all_dim",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_layer_freq",
    "moe_router_topk",
    "moe_router_score_function",
    "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_enable_expert_bias",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
)


@dataclass(frozen=True)
class ModelConfig(MoEOptions, MultiTokenOptions, LatentAttentionOptions, PositionOptions):
    """The decoder's shape and style (GPT-2 or Llama-like are combinations of these; the
    mixture-of-experts fields come from MoEOptions)."""

    num_layers: int = option(
        2,
        "number of transformer layers",
        required=FROM_CHECKPOINT,
        aliases=("--encoder-num-layers",),
    )
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
    seq_length: int = option(
        128,
        "tokens per training sample",
        required=FROM_CHECKPOINT,
        aliases=("--encoder-seq-length",),
    )
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
    normalization: str = option("LayerNorm", "norm type", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = option(1e-5, "epsilon of the norms")
    apply_layernorm_1p: bool = option(
        False,
        "norm weights stored centred on zero (initialised to 0) and applied as 1 + weight; "
        "exported to Hugging Face as 1 + weight",
    )
    swiglu: bool = option(False, "SwiGLU MLP instead of GELU")
    openai_gelu: bool = option(False, "GELU's tanh approximation, as OpenAI's GPT-2 uses")
    bias_gelu_fusion: bool = option(
        True,
        "the exact GELU where Megatron-LM's fused bias-GELU (its default with GELU and linear "
        "biases) computes GELU's tanh approximation",
        flag="--no-bias-gelu-fusion",
        action="store_false",
    )
    squared_relu: bool = option(False, "squared ReLU, relu(x)^2, instead of GELU in the MLP")
    quick_geglu: bool = option(
        False, "a gated MLP with quick GELU, x sigmoid(1.702 x), on the gate (gpt-oss's)"
    )
    glu_linear_offset: float = option(
        0.0, "a gated MLP's activation(gate) x (up + offset) (gpt-oss: 1)"
    )
    activation_func_clamp_value: float | None = option(
        None,
        "a gated MLP clamps its gate to at most this and its up projection to [-this, this] "
        "before the activation (gpt-oss: 7)",
    )
    add_bias_linear: bool = option(
        True, "no biases in linear layers", flag="--disable-bias-linear", action="store_false"
    )
    untie_embeddings_and_output_weights: bool = option(
        False, "separate output layer instead of reusing the input embedding"
    )
    qk_layernorm: bool = option(False, "normalise queries and keys per head")
    qk_layernorm_across_heads: bool = option(
        False,
        "with --qk-layernorm (RMSNorm): one norm over each token's whole query projection and "
        "one over its key projection, all heads at once, as OLMoE (not a Megatron-LM flag)",
    )
    window_size: str | None = option(
        None,
        "sliding-window attention, as Megatron-LM's (left, right): each token attends to "
        "itself and the `left` tokens before it (right must be 0: causal); default: all",
    )
    window_attn_skip_freq: str | None = option(
        None,
        "with --window-size, the layers that attend fully instead: N (layers N, 2N, ... counted "
        "from 1; gpt-oss alternates, 2) or a 0/1 list per layer, 1 windowed, such as "
        "'([1,0]*12)'",
    )
    softmax_type: str = option(
        "vanilla",
        "the attention softmax: vanilla; off-by-one (a zero logit in every row's denominator); "
        "learnable (a learned logit per head: gpt-oss's attention sinks)",
        choices=["vanilla", "off-by-one", "learnable"],
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
        None,
        "activation recomputation",
        choices=["full", "selective"],
        switches={"--recompute-activations": "selective"},
    )
    recompute_method: str | None = option(
        None,
        "with full recomputation: uniform chunks or the first N layers",
        choices=["uniform", "block"],
    )
    recompute_num_layers: int | None = option(
        None, "layers per recomputed chunk (uniform) or layers recomputed per stage (block)"
    )
    recompute_modules: list[str] | None = option(
        None,
        "with --recompute-granularity selective, the parts rerun in backward instead of kept: "
        "core_attn (the default), mlp (a dense layer's), layernorm (a layer's two norms), "
        "moe (a whole MoE layer, its all-to-all included), moe_act (the experts' activation; "
        "with --moe-grouped-gemm), shared_experts",
        choices=list(RECOMPUTE_MODULES),
    )
    moe_layer_recompute: bool = option(
        False,
        "rerun each MoE layer in backward (Megatron-LM's deprecated spelling of "
        "--recompute-granularity selective --recompute-modules moe, which it adds)",
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
        # written before the fused bias-GELU's tanh approximation: the exact GELU
        record.setdefault("bias_gelu_fusion", False)
        return cls(**record)

    @property
    def gelu_tanh(self) -> bool:
        """A GELU MLP computes GELU's tanh approximation: with --openai-gelu, or as
        Megatron-LM's fused bias-GELU does by default (linear biases, no
        --no-bias-gelu-fusion); otherwise the exact GELU."""
        return self.openai_gelu or (self.bias_gelu_fusion and self.add_bias_linear)

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
    def gated_linear_unit(self) -> bool:
        """The MLP's up projection makes a gate and an up half (--swiglu, --quick-geglu)."""
        return self.swiglu or self.quick_geglu

    def window_of(self, layer: int) -> int | None:
        """The attention window of layer `layer` (counted from 0; None: all earlier tokens)."""
        window = self.attention_window
        if window is None or self.window_attn_skip_freq is None:
            return window
        return window if self.windowed_layers()[layer] else None

    def windowed_layers(self) -> list[int]:
        """--window-attn-skip-freq as one 0/1 per layer, 1 windowed (Megatron-LM's meaning)."""
        text = str(self.window_attn_skip_freq).strip()
        flag = f"--window-attn-skip-freq {text}"
        every = layer_interval(text, flag)
        if every is not None:
            return [int((layer + 1) % every != 0) for layer in range(self.num_layers)]
        return listed_layers(text, self.num_layers, flag, "1 (windowed) or 0 (full attention)")

    @property
    def has_sinks(self) -> bool:
        """A logit beside every attention row's scores (--softmax-type off-by-one, learnable)."""
        return self.softmax_type != "vanilla"

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    def padded_vocab_size(self, tp: int) -> int:
        if self.vocab_size is None:
            raise ConfigError("the vocabulary size is unknown; give a tokenizer or --vocab-size")
        multiple = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    @property
    def selective_modules(self) -> frozenset[str]:
        """The parts selective recomputation reruns (megatron-core's rule: --recompute-modules,
        by default core_attn; --moe-layer-recompute makes the granularity selective and adds
        moe); empty without it."""
        if self.recompute_granularity == "full":
            return frozenset()
        if self.recompute_granularity != "selective" and not self.moe_layer_recompute:
            return frozenset()
        modules = set(self.recompute_modules or ["core_attn"])
        return frozenset(modules | ({"moe"} if self.moe_layer_recompute else set()))

    def validate(self, tp: int = 1, sequence_parallel: bool = False) -> None:
        """Raise ConfigError naming the flag to change for any impossible shape."""
        h, n, g = self.hidden_size, self.num_attention_heads, self.query_groups
        positive = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.qk_layernorm_across_heads and not (
            self.qk_layernorm and self.normalization == "RMSNorm"
        ):
            raise ConfigError(
                "--qk-layernorm-across-heads normalises with --qk-layernorm and --normalization "
                "RMSNorm (as OLMoE); add both or drop it"
            )
        if self.quick_geglu and (self.swiglu or self.squared_relu):
            other = "--swiglu" if self.swiglu else "--squared-relu"
            raise ConfigError(f"--quick-geglu and {other} are two activations; give one")
        glu_options = self.glu_linear_offset != 0.0 or self.activation_func_clamp_value is not None
        if glu_options and not self.gated_linear_unit:
            raise ConfigError(
                "--glu-linear-offset and --activation-func-clamp-value shape a gated MLP; add "
                "--swiglu or --quick-geglu"
            )
        if self.squared_relu and (self.swiglu or self.openai_gelu):
            flag = "--swiglu" if self.swiglu else "--openai-gelu"
            raise ConfigError(f"--squared-relu replaces GELU: drop {flag} (as in Megatron-LM)")
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
        scaling = rope_scaling_of(self)
        dynamic = scaling is not None and scaling["rope_type"] == "dynamic"
        if self.max_positions < self.seq_length and not dynamic:
            raise ConfigError(
                f"--max-position-embeddings {self.max_positions} < --seq-length "
                f"{self.seq_length}; raise --max-position-embeddings to at least "
                f"{self.seq_length} or lower --seq-length"
            )
        _ = self.attention_window  # --window-size parses
        if self.window_attn_skip_freq is not None:
            self.windowed_layers()  # parses and fits --num-layers
        if self.has_sinks and self.attention_dropout > 0:
            raise ConfigError(
                f"--softmax-type {self.softmax_type} with --attention-dropout "
                f"{self.attention_dropout}: dropout on the probabilities of a softmax with "
                "sinks is not built here; give --attention-dropout 0 (gpt-oss trains without)"
            )
        self.validate_positions()
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
        if self.moe_layer_recompute and self.recompute_granularity == "full":
            raise ConfigError(
                "--moe-layer-recompute with --recompute-granularity full: the layers are "
                "recomputed whole already; drop one (as Megatron-LM refuses)"
            )
        if "moe_act" in self.selective_modules and not self.moe_grouped_gemm:
            raise ConfigError(
                "--recompute-modules moe_act needs --moe-grouped-gemm (as in Megatron-LM)"
            )
        if "shared_experts" in self.selective_modules and self.moe_shared_expert_overlap:
            raise ConfigError(
                "--recompute-modules shared_experts cannot work with --moe-shared-expert-overlap "
                "(as in Megatron-LM); drop one"
            )
        if self.make_vocab_size_divisible_by < 1:
            raise ConfigError("--make-vocab-size-divisible-by must be at least 1")
        self.validate_moe(self.num_layers)
        self.validate_latent_attention(tp)
        self.validate_multi_token()
