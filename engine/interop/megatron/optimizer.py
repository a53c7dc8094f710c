"""Megatron-LM's Adam state in a torch_dist checkpoint -> ours.

megatron-core saves the optimizer state in one of these layouts, all read here:
- model space, without --use-distributed-optimizer: each state tensor under its parameter's key
  and global shape (`optimizer.state.exp_avg.<param key>`, `...exp_avg_sq...`, the fp32
  master of a bf16/fp16 parameter under `optimizer.state.fp32_param`), Adam's step as
  `common_step` in common.pt;
- model space, the distributed optimizer saved with --dist-ckpt-optim-fully-reshardable
  (`param_state_sharding_type` fully_reshardable, or the older fully_sharded_model_space): the
  same moments, the master under `optimizer.state.param`, the step in each parameter group;
- `dp_reshardable`, Megatron-LM's default for the distributed optimizer: the flat gradient
  buckets of each tensor- and pipeline-parallel rank (engine/interop/megatron/buckets.py).
A mixture of experts saved with expert parallelism chains two optimizers (the dense parameters,
the routed experts): common.pt keys their entries 0 and 1, and the bucket layout prefixes their
tensors `chained_0.` and `chained_1.`; the model-space layouts keep the parameters' keys.
The older bucket layouts (dp_zero_gather_scatter, fully_sharded_bucket_space) are refused in
one line naming the fix.

`optimizer_state(...)` returns a reader: `read(kind, key, index)` gives our state kind (exp_avg,
exp_avg_sq, master) of the checkpoint's tensor `key` (at `index` of its leading axes: a layer) in
that tensor's stored
layout, in fp32, or None for a master the checkpoint does not keep (fp32 runs: the master is
the weights); `has_master` says whether it keeps masters, `step` is Adam's step.
"""

from __future__ import annotations

import torch

from engine.config.model import ModelConfig
from engine.errors import InputError
from engine.interop.megatron.layout import MegatronCheckpoint

# Both keep every state tensor under its parameter's key and global shape.
_MODEL_SPACE = ("fully_reshardable", "fully_sharded_model_space")
_BUCKETS = "dp_reshardable"
# our optimizer state kind -> megatron-core's names for it, first present wins
_KINDS = {
    "exp_avg": ("exp_avg",),
    "exp_avg_sq": ("exp_avg_sq",),
    "master": ("fp32_param", "param"),
}


def _saved_optimizer(common: dict) -> dict | None:
    """The optimizer's entry in common.pt (the first of chained optimizers, which megatron-core
    keys 0, 1, ...), or None when the checkpoint holds no optimizer."""
    saved = common.get("optimizer")
    if isinstance(saved, dict) and isinstance(saved.get(0), dict):
        return saved[0]
    return saved if isinstance(saved, dict) else None


def _optimizer_common(common: dict) -> dict | None:
    """The inner optimizer's state dict in common.pt (the distributed optimizer nests it one
    level deeper), or None when the checkpoint holds no optimizer."""
    saved = _saved_optimizer(common)
    if saved is None:
        return None
    return saved.get("optimizer", saved) if isinstance(saved.get("optimizer"), dict) else saved


def _common_step(common: dict) -> int:
    """Adam's step count as common.pt records it (0 when none is recorded)."""
    inner = _optimizer_common(common) or {}
    step = (inner.get("state") or {}).get("common_step")
    if step is None:
        steps = [g.get("step") for g in inner.get("param_groups") or [] if g.get("step")]
        step = steps[0] if steps else 0
    return int(step.item() if torch.is_tensor(step) else step)


class _ModelSpaceState:
    """Adam's state stored per parameter under the parameter's key."""

    def __init__(self, source: MegatronCheckpoint, common: dict):
        self.source, self.step = source, _common_step(common)
        masters = tuple(f"optimizer.state.{name}." for name in _KINDS["master"])
        self.has_master = any(k.startswith(masters) for k in source.stored)

    def read(self, kind: str, key: str, index: tuple[int, ...]) -> torch.Tensor | None:
        for name in _KINDS[kind]:
            stored = f"optimizer.state.{name}.{key}"
            if stored in self.source.stored:
                return self.source.read(stored, index).float()
        if kind == "master":
            return None  # the master starts from the weights
        raise InputError(f"{self.source.path}: its optimizer state has no {kind} for {key}")


class _BucketState:
    """Adam's state in the distributed optimizer's buckets (dp_reshardable)."""

    _NAMES = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "master": "param"}
    has_master = True

    def __init__(self, source: MegatronCheckpoint, cfg: ModelConfig, args):
        from engine.interop.megatron.buckets import DistributedOptimizerBuckets

        self.buckets = DistributedOptimizerBuckets(source, cfg, args)
        self.step = self.buckets.step()

    def read(self, kind: str, key: str, index: tuple[int, ...]) -> torch.Tensor:
        return self.buckets.read(self._NAMES[kind], key, index)


def optimizer_state(source: MegatronCheckpoint, common: dict, cfg: ModelConfig):
    """A reader of the checkpoint's Adam state (module doc), or None when it holds none; an
    InputError when it holds it in an older bucket layout."""
    saved = common.get("optimizer")
    if not isinstance(saved, dict):
        return None
    chained = [k for k in saved if isinstance(k, int)]
    args = common.get("args")
    experts_apart = cfg.is_moe and int(getattr(args, "expert_model_parallel_size", 1) or 1) > 1
    if chained and (sorted(chained) != [0, 1] or not experts_apart):
        raise InputError(
            f"{source.path}: its optimizer state is split over {len(chained)} chained "
            "optimizers where only a mixture of experts' dense and expert-parallel ones are "
            "read (--overlap-param-gather-with-optimizer-step saves one per model chunk); "
            "load it with --no-load-optim (weights, iteration and samples only)"
        )
    kind = _saved_optimizer(common).get("param_state_sharding_type")
    if kind == _BUCKETS:
        return _BucketState(source, cfg, args)
    if kind is not None and kind not in _MODEL_SPACE:
        raise InputError(
            f"{source.path}: its optimizer state is in megatron-core's '{kind}' layout, which "
            "is not read here; re-save it in Megatron-LM with "
            "--dist-ckpt-optim-fully-reshardable, or load it here with --no-load-optim "
            "(weights, iteration and samples only)"
        )
    if not any(k.startswith("optimizer.state.exp_avg.") for k in source.stored):
        return None
    return _ModelSpaceState(source, common)


def check_state_kinds(path: str, kinds) -> None:
    """InputError unless every state kind of this run's optimizer is one Adam saves."""
    others = sorted(set(kinds) - set(_KINDS))
    if others:
        raise InputError(
            f"{path}: holds Adam's state, but this run's optimizer keeps {others[0]}; use "
            "--optimizer adam, or --no-load-optim to start the optimizer afresh"
        )
