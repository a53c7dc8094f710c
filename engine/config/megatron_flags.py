"""Megatron-LM flags its example scripts pass that this engine does not act on.

Two kinds, so that a Megatron-LM script runs unchanged or stops with one line:

- flags that only pick an implementation detail (a kernel, a fusion, an allocator or garbage
  collector habit, the checkpoint container Megatron-LM writes): accepted, and named in one line
  at start as accepted without effect;
- flags that ask for a feature this engine does not have (FP8, mixture of experts, context or
  expert parallelism above 1): refused in one line naming the feature, exit code 2.

Every field defaults to None, meaning "not given", so that only the flags a script passes are
reported; the help text gives Megatron-LM's default.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from engine.config.arguments import flag_of
from engine.config.fields import option
from engine.errors import ConfigError

_ON = {"action": "store_const", "const": True}
_OFF = {"action": "store_const", "const": False}


@dataclass(frozen=True)
class MegatronCompatConfig:
    """Megatron-LM flags accepted without effect, or refused (see the module docstring)."""

    # --- accepted without effect -------------------------------------------------------------
    use_mcore_models: bool | None = option(
        None, "Megatron-LM: use megatron-core models (the only kind here; no effect)", **_ON
    )
    attention_backend: str | None = option(
        None,
        "Megatron-LM: which attention kernel (default auto; one attention path here, no effect)",
        choices=["auto", "flash", "fused", "unfused", "local"],
    )
    masked_softmax_fusion: bool | None = option(
        None,
        "Megatron-LM: no fused scale-mask-softmax kernel (no effect)",
        flag="--no-masked-softmax-fusion",
        **_OFF,
    )
    cross_entropy_loss_fusion: bool | None = option(
        None,
        "Megatron-LM: fused cross-entropy (no effect; the fused kernel follows "
        "--use-fused-kernels)",
        **_ON,
    )
    create_attention_mask_in_dataloader: bool | None = option(
        None,
        "Megatron-LM: no attention mask from the data loader (none is ever made here; no effect)",
        flag="--no-create-attention-mask-in-dataloader",
        **_OFF,
    )
    mmap_bin_files: bool | None = option(
        None,
        "Megatron-LM: read .bin files without mmap (no effect; always memory-mapped)",
        flag="--no-mmap-bin-files",
        **_OFF,
    )
    fsdp_double_buffer: bool | None = option(
        None,
        "Megatron-LM: reuse two buffers for FSDP's gathers (allocation detail; no effect)",
        **_ON,
    )
    fsdp_manual_registration: bool | None = option(
        None,
        "Megatron-LM: register FSDP buffers with NCCL user buffers (no NCCL buffers here; no "
        "effect)",
        **_ON,
    )
    manual_gc: bool | None = option(
        None, "Megatron-LM: Python garbage collection by hand (no effect)", **_ON
    )
    manual_gc_interval: int | None = option(
        None, "Megatron-LM: steps between manual collections (default 0; no effect)"
    )
    empty_unused_memory_level: int | None = option(
        None,
        "Megatron-LM: empty the CUDA cache each step (1) or also after forward/backward (2) "
        "(default 0; no effect)",
        choices=[0, 1, 2],
    )
    calculate_per_token_loss: bool | None = option(
        None,
        "Megatron-LM: loss as the mean over every token of the global batch (what is computed "
        "here already: every token counts and every micro-batch holds as many; no effect)",
        **_ON,
    )
    log_throughput: bool | None = option(
        None,
        "Megatron-LM: throughput in the log line (always logged here: tokens/s, TFLOP/s, MFU)",
        **_ON,
    )
    ckpt_format: str | None = option(
        None,
        "Megatron-LM: checkpoint container (default torch_dist); accepted as torch_dist, "
        "this engine's sharded format is written either way",
        choices=["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"],
    )
    add_position_embedding: bool | None = option(
        None,
        "Megatron-LM: no learned position embedding (with --position-embedding-type rope there "
        "is none; no effect)",
        flag="--no-position-embedding",
        **_OFF,
    )
    # --- accepted at the value that means "off", refused above it ----------------------------
    expert_model_parallel_size: int | None = option(
        None, "expert-parallel size (default 1; only 1: no mixture of experts here)"
    )
    # --- refused: features this engine does not have ----------------------------------------
    fp8_format: str | None = option(
        None, "Megatron-LM: FP8 training (refused: no FP8 here)", choices=["e4m3", "hybrid"]
    )
    fp8_amax_history_len: int | None = option(None, "Megatron-LM: FP8 (refused: no FP8 here)")
    fp8_amax_compute_algo: str | None = option(
        None, "Megatron-LM: FP8 (refused: no FP8 here)", choices=["most_recent", "max"]
    )
    fp8_param_gather: bool | None = option(None, "Megatron-LM: FP8 (refused: no FP8 here)", **_ON)
    num_experts: int | None = option(None, "Megatron-LM: mixture of experts (refused: no MoE here)")
    moe_router_topk: int | None = option(None, "Megatron-LM: MoE (refused: no MoE here)")
    moe_router_load_balancing_type: list[str] | None = option(
        None, "Megatron-LM: MoE (refused: no MoE here)", nargs="+"
    )
    moe_aux_loss_coeff: list[float] | None = option(
        None, "Megatron-LM: MoE (refused: no MoE here)", nargs="+"
    )
    moe_grouped_gemm: bool | None = option(None, "Megatron-LM: MoE (refused: no MoE here)", **_ON)
    moe_token_dispatcher_type: str | None = option(None, "Megatron-LM: MoE (refused: no MoE here)")


NO_EFFECT = (
    "use_mcore_models",
    "attention_backend",
    "masked_softmax_fusion",
    "cross_entropy_loss_fusion",
    "create_attention_mask_in_dataloader",
    "mmap_bin_files",
    "fsdp_double_buffer",
    "fsdp_manual_registration",
    "manual_gc",
    "manual_gc_interval",
    "empty_unused_memory_level",
    "calculate_per_token_loss",
    "log_throughput",
    "ckpt_format",
    "add_position_embedding",
    "expert_model_parallel_size",
)


def _flag_of(name: str) -> str:
    return flag_of(next(f for f in fields(MegatronCompatConfig) if f.name == name))


def _given(compat: MegatronCompatConfig) -> dict[str, object]:
    return {
        f.name: getattr(compat, f.name)
        for f in fields(compat)
        if getattr(compat, f.name) is not None
    }


def check_compat(
    compat: MegatronCompatConfig, position_embedding_type: str, megatron_fsdp: bool = False
) -> None:
    """ConfigError (one line) for a flag that asks for a feature this engine lacks.
    `megatron_fsdp`: --use-megatron-fsdp is on, with which Megatron-LM requires --ckpt-format
    fsdp_dtensor (accepted then: this engine writes its own checkpoints either way)."""
    given = _given(compat)
    fp8 = [n for n in given if n.startswith("fp8_")]
    if fp8:
        raise ConfigError(
            f"{_flag_of(fp8[0])}: FP8 training is not available in this engine; drop the "
            "--fp8-* flags (bf16 trains with --bf16)"
        )
    moe = [n for n in given if n == "num_experts" or n.startswith("moe_")]
    if moe or (given.get("expert_model_parallel_size") or 1) > 1:
        flag = _flag_of(moe[0]) if moe else "--expert-model-parallel-size"
        raise ConfigError(
            f"{flag}: mixture-of-experts (MoE) layers are not available in this engine yet; "
            "drop --num-experts, the --moe-* flags and --expert-model-parallel-size to train "
            "the dense model"
        )
    if given.get("expert_model_parallel_size", 1) < 1:
        raise ConfigError("--expert-model-parallel-size must be at least 1")
    accepted = ("torch_dist", "fsdp_dtensor") if megatron_fsdp else ("torch_dist",)
    if given.get("ckpt_format", "torch_dist") not in accepted:
        raise ConfigError(
            f"--ckpt-format {given['ckpt_format']}: only torch_dist (and fsdp_dtensor with "
            "--use-megatron-fsdp) is accepted (this engine writes its own sharded "
            "checkpoints); use torch_dist or leave it out"
        )
    if (
        given.get("add_position_embedding") is False
        and position_embedding_type == "learned_absolute"
    ):
        raise ConfigError(
            "--no-position-embedding goes with --position-embedding-type rope (as in "
            "Megatron-LM); add that flag or drop this one"
        )


def no_effect_line(
    compat: MegatronCompatConfig, model=None, runtime=None, parallel=None
) -> str | None:
    """The one line printed at start naming the Megatron-LM flags accepted without effect
    (and --num-query-groups, which Megatron-LM reads only with --group-query-attention,
    --grad-reduce-in-bf16, which it reads only with --bf16, and
    --data-parallel-sharding-strategy, which it reads only with --use-megatron-fsdp)."""
    given = _given(compat)
    names = [_flag_of(n) for n in NO_EFFECT if n in given]
    if model is not None and model.num_query_groups is not None and not model.group_query_attention:
        names.append("--num-query-groups (without --group-query-attention)")
    if runtime is not None and runtime.grad_reduce_in_bf16 and not runtime.bf16:
        names.append("--grad-reduce-in-bf16 (without --bf16)")
    if (
        parallel is not None
        and parallel.data_parallel_sharding_strategy
        and not parallel.use_megatron_fsdp
    ):
        names.append("--data-parallel-sharding-strategy (without --use-megatron-fsdp)")
    if not names:
        return None
    return "Megatron-LM flags accepted without effect here: " + ", ".join(names)


def flag_names() -> set[str]:
    """Every flag this module accepts (for tests and the flag table)."""
    return {_flag_of(f.name) for f in fields(MegatronCompatConfig)}
