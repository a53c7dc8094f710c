"""The mixture-of-experts part of the model's config (`MoEOptions`, which `ModelConfig` extends),
with Megatron-LM's flag names, meanings and defaults (megatron-core 0.16.1), and its checks.

A layer is a mixture of experts where `moe_layer_pattern` says 1: --moe-layer-freq N makes every
N-th layer one (layers 0, N, 2N, ...), or a list expression such as `([0]*3+[1]*11)` gives one
0/1 per layer. The expression is read by a small parser of list literals, `+` and `*` (never
evaluated as Python).
"""

from __future__ import annotations

import ast
from dataclasses import MISSING, dataclass, fields

from engine.config.fields import option
from engine.errors import ConfigError

LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")


@dataclass(frozen=True)
class MoEOptions:
    """Mixture-of-experts layers: experts, router, load balancing, dispatch."""

    num_experts: int | None = option(
        None, "mixture of experts: routed experts per MoE layer (default: a dense model)"
    )
    moe_ffn_hidden_size: int | None = option(
        None, "hidden size of each routed expert's MLP (default --ffn-hidden-size)"
    )
    moe_layer_freq: str = option(
        "1",
        "which layers are MoE: N for every N-th (layers 0, N, 2N, ...), or a list of 0/1 per "
        "layer such as '([0]*3+[1]*11)'",
    )
    moe_router_topk: int = option(2, "experts each token is routed to")
    moe_router_score_function: str = option(
        "softmax", "router scores: softmax or sigmoid", choices=["softmax", "sigmoid"]
    )
    moe_router_pre_softmax: bool = option(
        False,
        "softmax over all experts before the top-k (default: softmax over the top-k logits, "
        "which renormalises the chosen experts' probabilities)",
    )
    moe_router_topk_scaling_factor: float | None = option(
        None, "multiply the top-k probabilities by this"
    )
    moe_router_num_groups: int | None = option(
        None, "group-limited routing: experts split into this many groups"
    )
    moe_router_group_topk: int | None = option(
        None, "group-limited routing: each token's experts come from this many groups"
    )
    moe_router_enable_expert_bias: bool = option(
        False,
        "auxiliary-loss-free balancing: a per-expert bias added to the scores for choosing "
        "experts, updated after each step from the tokens each expert received (sigmoid router)",
    )
    moe_router_bias_update_rate: float = option(
        1e-3, "step of the expert bias update: bias += rate x sign(mean load - load)"
    )
    moe_router_dtype: str | None = option(
        None,
        "compute the router's logits and scores in fp32 or fp64 (default: the model's dtype)",
        choices=["fp32", "fp64"],
    )
    moe_input_jitter_eps: float | None = option(
        None, "multiply the router's input by uniform noise in [1 - eps, 1 + eps] in training"
    )
    moe_router_load_balancing_type: list[str] = option(
        ["aux_loss"],
        "load balancing: aux_loss (over each micro-batch), seq_aux_loss (per sequence), "
        "global_aux_loss (over the global batch), sinkhorn or none; several, each with its "
        "--moe-aux-loss-coeff",
        choices=list(LOAD_BALANCING),
    )
    moe_aux_loss_coeff: list[float] = option(
        [0.0], "coefficient of each load-balancing loss (one per --moe-router-load-balancing-type)"
    )
    moe_z_loss_coeff: float | None = option(
        None, "coefficient of the router z-loss, mean logsumexp(logits)^2"
    )
    moe_expert_capacity_factor: float | None = option(
        None,
        "token dropping: each expert takes at most ceil(tokens x topk / experts x this) tokens "
        "(default: dropless)",
    )
    moe_token_drop_policy: str = option(
        "probs",
        "with a capacity: drop the tokens of lowest probability (probs) or the last (position)",
        choices=["probs", "position"],
    )
    moe_pad_expert_input_to_capacity: bool = option(
        False, "with a capacity: every expert computes exactly its capacity of tokens"
    )
    moe_apply_probs_on_input: bool = option(
        False, "multiply the router probability into the expert's input, not its output (top-1)"
    )
    moe_shared_expert_intermediate_size: int | None = option(
        None, "hidden size of the shared experts beside the routed ones (all of them together)"
    )
    moe_shared_expert_gate: bool = option(
        False, "a sigmoid gate on the shared experts' output (Qwen2-MoE)"
    )
    moe_shared_expert_overlap: bool = option(
        False,
        "compute the shared experts during the token exchange (the same results; needs "
        "--moe-token-dispatcher-type alltoall)",
    )
    moe_grouped_gemm: bool = option(
        False,
        "run the experts as one grouped GEMM (torch._grouped_mm where the device has it, a "
        "batched loop elsewhere; the same numerics)",
    )
    moe_token_dispatcher_type: str = option(
        "allgather",
        "how tokens reach their experts' ranks: allgather, alltoall or flex (the same results "
        "here)",
        choices=["allgather", "alltoall", "flex"],
    )

    # --- derived --------------------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    def moe_layer_pattern(self, num_layers: int) -> list[int]:
        """1 for each MoE layer, 0 for each dense one (all 0 without --num-experts)."""
        if not self.is_moe:
            return [0] * num_layers
        return layer_pattern(self.moe_layer_freq, num_layers)

    @property
    def expert_ffn_size(self) -> int:
        """Each routed expert's hidden size (default ModelConfig.ffn_size, the dense MLP's)."""
        return self.moe_ffn_hidden_size or self.ffn_size

    def aux_loss_coeff(self, kind: str) -> float:
        """The coefficient of one load-balancing loss (0.0 where it is not chosen)."""
        for chosen, coeff in zip(
            self.moe_router_load_balancing_type, self.moe_aux_loss_coeff, strict=False
        ):
            if chosen == kind:
                return coeff
        return 0.0

    @property
    def uses_sinkhorn(self) -> bool:
        return "sinkhorn" in self.moe_router_load_balancing_type

    # --- checks -----------------------------------------------------------------------------

    def validate_moe(self, num_layers: int) -> None:
        """ConfigError (one line naming the flag and the fix) for MoE settings that cannot
        be, checked as megatron-core checks them, and MoE flags without --num-experts."""
        if self.num_experts is not None and self.num_experts < 0:
            raise ConfigError(f"--num-experts {self.num_experts} must be positive (or 0: dense)")
        if not self.is_moe:
            for field in fields(MoEOptions):
                if field.name != "num_experts" and getattr(self, field.name) != _default(field):
                    flag = "--" + field.name.replace("_", "-")
                    raise ConfigError(f"{flag} is a mixture-of-experts flag: add --num-experts N")
            return
        experts, topk = self.num_experts, self.moe_router_topk
        if not 1 <= topk <= experts:
            raise ConfigError(
                f"--moe-router-topk {topk} must be between 1 and --num-experts {experts}"
            )
        if self.moe_ffn_hidden_size is not None and self.moe_ffn_hidden_size < 1:
            raise ConfigError("--moe-ffn-hidden-size must be at least 1")
        if not any(self.moe_layer_pattern(num_layers)):  # (parses, one 0/1 per layer)
            raise ConfigError(
                f"--moe-layer-freq {self.moe_layer_freq} makes no layer a mixture of experts: "
                "mark one, or drop --num-experts"
            )
        self._validate_router(experts, topk)
        self._validate_balancing()
        capacity = self.moe_expert_capacity_factor
        if capacity is not None and capacity <= 0:
            raise ConfigError(
                f"--moe-expert-capacity-factor {capacity} must be positive (leave it out for "
                "dropless routing)"
            )
        if capacity is not None and self.uses_sinkhorn:
            raise ConfigError(
                "--moe-expert-capacity-factor works with aux_loss, seq_aux_loss, "
                "global_aux_loss or none load balancing, not sinkhorn"
            )
        if self.moe_pad_expert_input_to_capacity and capacity is None:
            raise ConfigError(
                "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"
            )
        if self.moe_apply_probs_on_input and topk != 1:
            raise ConfigError("--moe-apply-probs-on-input works with --moe-router-topk 1 only")
        shared = self.moe_shared_expert_intermediate_size
        if shared is not None and shared < 1:
            raise ConfigError("--moe-shared-expert-intermediate-size must be at least 1")
        if self.moe_shared_expert_gate and shared is None:
            raise ConfigError(
                "--moe-shared-expert-gate gates the shared experts: add "
                "--moe-shared-expert-intermediate-size"
            )
        if self.moe_shared_expert_overlap and self.moe_token_dispatcher_type != "alltoall":
            raise ConfigError(
                "--moe-shared-expert-overlap works with --moe-token-dispatcher-type alltoall only"
            )

    def _validate_router(self, experts: int, topk: int) -> None:
        score, pre = self.moe_router_score_function, self.moe_router_pre_softmax
        if topk == 1 and score == "softmax" and not pre and not self.uses_sinkhorn:
            raise ConfigError(
                "--moe-router-topk 1 with a softmax router needs --moe-router-pre-softmax "
                "(a softmax over one logit has no gradient)"
            )
        if self.moe_router_enable_expert_bias and score != "sigmoid":
            raise ConfigError(
                "--moe-router-enable-expert-bias works with --moe-router-score-function sigmoid"
            )
        groups, group_topk = self.moe_router_num_groups, self.moe_router_group_topk
        if group_topk is None:  # (--moe-router-num-groups alone: no effect, as there)
            return
        if not groups:
            raise ConfigError(
                "--moe-router-group-topk needs --moe-router-num-groups (group-limited routing)"
            )
        if groups < 1 or experts % groups:
            raise ConfigError(
                f"--num-experts {experts} is not divisible by --moe-router-num-groups {groups}"
            )
        if not 1 <= group_topk <= groups:
            raise ConfigError(
                f"--moe-router-group-topk {group_topk} must be between 1 and "
                f"--moe-router-num-groups {groups}"
            )
        if topk > group_topk * (experts // groups):
            raise ConfigError(
                f"--moe-router-topk {topk} is more than the {group_topk * (experts // groups)} "
                f"experts of --moe-router-group-topk {group_topk} groups allow"
            )

    def _validate_balancing(self) -> None:
        kinds, coeffs = self.moe_router_load_balancing_type, self.moe_aux_loss_coeff
        if len(kinds) != len(coeffs):
            raise ConfigError(
                f"--moe-aux-loss-coeff gives {len(coeffs)} value(s) for "
                f"{len(kinds)} --moe-router-load-balancing-type(s): give one each"
            )
        if len(set(kinds)) != len(kinds):
            raise ConfigError("--moe-router-load-balancing-type names a type twice")
        if self.uses_sinkhorn and self.aux_loss_coeff("sinkhorn"):
            raise ConfigError("sinkhorn load balancing takes no --moe-aux-loss-coeff: give 0")
        if self.uses_sinkhorn and len(kinds) > 1:
            raise ConfigError("sinkhorn load balancing cannot be combined with another type")
        if any(c < 0 for c in coeffs) or (self.moe_z_loss_coeff or 0) < 0:
            raise ConfigError("--moe-aux-loss-coeff and --moe-z-loss-coeff must not be negative")


def _default(field):
    if field.default_factory is not MISSING:
        return field.default_factory()
    return field.default


def layer_pattern(expression: str | int, num_layers: int) -> list[int]:
    """--moe-layer-freq as one 0/1 per layer (ConfigError naming the flag when it is not)."""
    text = str(expression).strip()
    flag = f"--moe-layer-freq {text}"
    every = layer_interval(text, flag)
    if every is not None:
        return [1 if layer % every == 0 else 0 for layer in range(num_layers)]
    return listed_layers(text, num_layers, flag, "0 (dense) or 1 (MoE)")


def layer_interval(text: str, flag: str) -> int | None:
    """N of a per-layer flag given as an integer (None when it is a list)."""
    if "[" not in text:
        try:
            every = int(text)
        except ValueError:
            raise ConfigError(
                f"{flag}: give an integer N or a list such as '([0]*3+[1]*11)'"
            ) from None
        if every < 1:
            raise ConfigError(f"{flag}: N must be at least 1")
        return every
    return None


def listed_layers(text: str, num_layers: int, flag: str, entries: str) -> list[int]:
    """A per-layer flag's list ('([0]*3+[1]*11)': literals, + and *; never run as Python) as
    one 0/1 per layer; ConfigError naming `flag` when it is not one."""
    try:
        pattern = _list_value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError) as err:
        raise ConfigError(
            f"{flag}: {err}; give list literals joined by + and repeated by *, e.g. "
            "'([0]*3+[1]*11)'"
        ) from None
    if any(v not in (0, 1) for v in pattern):
        raise ConfigError(f"{flag}: each layer's entry must be {entries}")
    if len(pattern) != num_layers:
        raise ConfigError(
            f"{flag}: gives {len(pattern)} layers, the model has --num-layers {num_layers}"
        )
    return pattern


def _list_value(node) -> list[int]:
    """The list a node of [ints], +, * and parentheses stands for (nothing else is read)."""
    if isinstance(node, ast.List):
        values = []
        for item in node.elts:
            if not (isinstance(item, ast.Constant) and type(item.value) is int):
                raise ValueError("list entries must be integers")
            values.append(item.value)
        return values
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _list_value(node.left) + _list_value(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        left, right = node.left, node.right
        if isinstance(left, ast.Constant):
            left, right = right, left
        if not (isinstance(right, ast.Constant) and type(right.value) is int):
            raise ValueError("a list can only be repeated an integer number of times")
        if not 0 <= right.value <= 100_000:
            raise ValueError("a repeat count must be between 0 and 100000")
        return _list_value(left) * right.value
    raise ValueError("only list literals, + and * are read")
