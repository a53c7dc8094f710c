"""Megatron-LM's Adam state in a torch_dist checkpoint -> ours.

megatron-core saves the optimizer state in "model space" (each state tensor under the key of
its parameter, with the parameter's global shape, so any TP/PP reads it) in two cases:
- without --use-distributed-optimizer: `optimizer.state.exp_avg.<param key>` and
  `...exp_avg_sq...`, the fp32 master of a bf16/fp16 parameter under `optimizer.state.fp32_param`,
  and Adam's step as `common_step` in common.pt;
- the distributed optimizer saved with --dist-ckpt-optim-fully-reshardable
  (`param_state_sharding_type` fully_reshardable, or the older fully_sharded_model_space):
  the same moments, the master under `optimizer.state.param`, and the step in each parameter
  group.
Megatron-LM's default for the distributed optimizer (`dp_reshardable`) and the older bucket
formats store its flat gradient buffers as they are laid out in memory, which only a run with
megatron-core's own buffers can read; they are refused in one line naming the fix.
"""

from __future__ import annotations

import torch

from engine.errors import InputError

# Both keep every state tensor under its parameter's key and global shape.
_MODEL_SPACE = ("fully_reshardable", "fully_sharded_model_space")
# our optimizer state kind -> megatron-core's names for it, first present wins
_KINDS = {
    "exp_avg": ("exp_avg",),
    "exp_avg_sq": ("exp_avg_sq",),
    "master": ("fp32_param", "param"),
}


def _optimizer_common(common: dict) -> dict | None:
    """The inner optimizer's state dict in common.pt (the distributed optimizer nests it one
    level deeper), or None when the checkpoint holds no optimizer."""
    saved = common.get("optimizer")
    if not isinstance(saved, dict):
        return None
    return saved.get("optimizer", saved) if isinstance(saved.get("optimizer"), dict) else saved


def optimizer_step(common: dict) -> int:
    """Adam's step count of the saved optimizer (0 when none is recorded)."""
    inner = _optimizer_common(common) or {}
    step = (inner.get("state") or {}).get("common_step")
    if step is None:
        steps = [g.get("step") for g in inner.get("param_groups") or [] if g.get("step")]
        step = steps[0] if steps else 0
    return int(step.item() if torch.is_tensor(step) else step)


def check_optimizer_format(path: str, common: dict, stored) -> bool:
    """True when the checkpoint holds optimizer state we can read; False when it holds none;
    an InputError when it holds it in a layout tied to megatron-core's buffers."""
    saved = common.get("optimizer")
    if not isinstance(saved, dict):
        return False
    kind = saved.get("param_state_sharding_type")
    if kind is not None and kind not in _MODEL_SPACE:
        raise InputError(
            f"{path}: its optimizer state is in megatron-core's '{kind}' layout, tied to "
            "Megatron-LM's own gradient buffers; re-save it in Megatron-LM with "
            "--dist-ckpt-optim-fully-reshardable, or load it here with --no-load-optim "
            "(weights, iteration and samples only)"
        )
    return any(k.startswith("optimizer.state.exp_avg.") for k in stored)


def check_state_kinds(path: str, kinds) -> None:
    """InputError unless every state kind of this run's optimizer is one Adam saves."""
    others = sorted(set(kinds) - set(_KINDS))
    if others:
        raise InputError(
            f"{path}: holds Adam's state, but this run's optimizer keeps {others[0]}; use "
            "--optimizer adam, or --no-load-optim to start the optimizer afresh"
        )


def optimizer_key(stored, kind: str, model_key: str) -> str | None:
    """megatron-core's key of our optimizer state `kind` for its parameter `model_key`."""
    for name in _KINDS[kind]:
        key = f"optimizer.state.{name}.{model_key}"
        if key in stored:
            return key
    return None
