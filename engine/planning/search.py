"""Every layout of a model on a world of devices, each with its predicted memory per rank and
step time, best first.

A layout is TP x CP x PP x DP = the world (TP within a node), with virtual pipeline stages,
micro-batch size, recomputation (none, selective, full: uniform, 1 layer per group), the
data-parallel sharding strategy and sequence parallelism; a mixture of experts adds expert
parallelism (EP dividing the experts) and the experts' tensor parallelism (TP's, or none),
folded out of TP x CP x DP as megatron-core folds them. Enumerated are those whose sizes
fit the model as the engine requires (TP divides the heads and key/value groups, PP the
layers evenly, virtual stages each PP stage's layers and the micro-batches a multiple of PP,
the sequence 2 x CP, the micro-batches the global batch, and ModelConfig.validate's checks
against TP and SP); tools/plan.py also runs the engine's own layout checks
(engine/train/preflight.py) on the rows it shows. A layout fits when the fullest pipeline stage's
predicted bytes (a bf16 run's: 16-bit parameters and activations) are at most
`memory_fraction` of the device's memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from engine.config.model import ModelConfig
from engine.errors import ConfigError
from engine.planning.hardware import Machine
from engine.planning.memory import STRATEGIES, Layout, rank_memory_bytes
from engine.planning.step_time import predict_step

# (the planner's own choices replace any --recompute-modules / --moe-layer-recompute given)
_PARTS = dict(recompute_modules=None, moe_layer_recompute=False)
RECOMPUTE = {
    "none": dict(recompute_granularity=None, recompute_method=None, **_PARTS),
    "selective": dict(recompute_granularity="selective", recompute_method=None, **_PARTS),
    "full": dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1, **_PARTS
    ),
}


@dataclass(frozen=True)
class SearchSpace:
    """The choices to try; None: every size the model and world allow."""

    tp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = (1,)
    pp: tuple[int, ...] | None = None
    dp: tuple[int, ...] | None = None
    virtual: tuple[int, ...] | None = None
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    recompute: tuple[str, ...] = tuple(RECOMPUTE)
    strategies: tuple[str, ...] = STRATEGIES
    sequence_parallel: tuple[bool, ...] = (True,)  # with TP above 1
    ep: tuple[int, ...] | None = None  # expert parallelism (a mixture of experts only)
    expert_tp: tuple[str, ...] = ("tp", "1")  # the experts split like TP (default) or whole
    tp_comm_overlap: bool = False  # Megatron-LM's Transformer Engine overlap (not this engine)
    fp32_wgrad_gemm: bool = False  # Megatron-LM's fused weight-gradient accumulation
    optimizer: str = "adam"  # or "muon" (--optimizer)
    muon_tp_mode: str = "blockwise"  # --muon-tp-mode


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _allowed(choices, value: int) -> bool:
    return choices is None or value in choices


def _model_fits(cfg: ModelConfig, tp: int, cp: int, sp: bool) -> bool:
    """What the engine checks of the model against TP and SP (ModelConfig.validate: the MLP,
    the vocabulary, the sequence under SP) and of each CP rank's part under SP."""
    try:
        cfg.validate(tp, sp)
    except ConfigError:
        return False
    return not (sp and (cfg.seq_length // cp) % tp)


def with_recompute(cfg: ModelConfig, recompute: str) -> ModelConfig:
    return replace(cfg, **RECOMPUTE[recompute])


def layouts(
    cfg: ModelConfig, world: int, global_batch: int, gpus_per_node: int, space: SearchSpace
) -> Iterator[tuple[str, Layout]]:
    """(recomputation, Layout) for every layout the sizes allow (module docstring)."""
    heads, groups, layers = cfg.num_attention_heads, cfg.query_groups, cfg.num_layers
    for tp in _divisors(world):
        if tp > gpus_per_node or heads % tp or groups % tp or not _allowed(space.tp, tp):
            continue
        for cp in _divisors(world // tp):
            if cfg.seq_length % (2 * cp) and cp > 1 or not _allowed(space.cp, cp):
                continue
            for pp in _divisors(world // (tp * cp)):
                if layers % pp or not _allowed(space.pp, pp):
                    continue
                dp = world // (tp * cp * pp)
                if global_batch % dp or not _allowed(space.dp, dp):
                    continue
                yield from _inner(cfg, space, tp, cp, pp, dp, global_batch // dp)


def _inner(cfg, space, tp, cp, pp, dp, per_replica) -> Iterator[tuple[str, Layout]]:
    per_stage = cfg.num_layers // pp
    for mbs in space.micro_batch_sizes:
        if per_replica % mbs:
            continue
        m = per_replica // mbs
        virtuals = [1]
        if pp > 1 and m % pp == 0:
            virtuals += [v for v in _divisors(per_stage) if v > 1]
        for v in virtuals:
            if not _allowed(space.virtual, v):
                continue
            for sp in space.sequence_parallel if tp > 1 else (False,):
                if not _model_fits(cfg, tp, cp, sp):
                    continue
                if cfg.is_moe and tp > 1 and not sp:
                    continue  # MoE under TP needs sequence parallelism (as megatron-core)
                for strategy in space.strategies if dp > 1 else ("no_shard",):
                    for ep, etp in _expert_layouts(cfg, space, tp * cp * dp, tp):
                        layout = Layout(
                            tp=tp, pp=pp, dp=dp, virtual=v, strategy=strategy, cp=cp,
                            sequence_parallel=sp, micro_batch_size=mbs, num_microbatches=m,
                            overlap_grad_reduce=dp > 1,
                            overlap_param_gather=strategy in ("optim", "optim_grads"),
                            tp_comm_overlap=space.tp_comm_overlap and tp > 1,
                            fp32_wgrad_gemm=space.fp32_wgrad_gemm, ep=ep, etp=etp,
                            optimizer=space.optimizer, muon_tp_mode=space.muon_tp_mode,
                        )  # fmt: skip
                        for recompute in space.recompute:
                            yield recompute, layout


def _expert_layouts(cfg: ModelConfig, space: SearchSpace, folded: int, tp: int):
    """(EP, ETP or None for TP) of a mixture of experts: EP dividing the experts, ETP x EP
    folding into TP x CP x DP (megatron-core), ETP above 1 only without biases and with an
    expert width it divides (engine/config/checks.py); (1, None) for a dense model."""
    if not cfg.is_moe:
        yield 1, None
        return
    for choice in dict.fromkeys(space.expert_tp):
        etp = tp if choice == "tp" else int(choice)
        if etp > 1 and (cfg.add_bias_linear or cfg.expert_ffn_size % etp) or folded % etp:
            continue
        if choice != "tp" and etp == tp:
            continue  # the same layout as the default
        for ep in _divisors(folded // etp):
            if cfg.num_experts % ep == 0 and _allowed(space.ep, ep):
                yield ep, None if choice == "tp" else etp


def memory_per_rank(cfg: ModelConfig, layout: Layout) -> dict[str, float]:
    """The fullest stage's predicted bytes by kind (stages 0 and p-1 bound the others: the
    first holds the embedding and the most micro-batches, the last the head)."""
    stages = {0, layout.pp - 1}
    return max((rank_memory_bytes(cfg, layout, r) for r in stages), key=lambda d: d["total"])


def plan(
    cfg: ModelConfig,
    world: int,
    global_batch: int,
    machine: Machine,
    space: SearchSpace = SearchSpace(),
    memory_fraction: float = 0.9,
) -> list[dict]:
    """Rows {recompute, layout, cfg, memory, prediction, fits}, fitting layouts first, then
    by predicted step time."""
    rows = []
    for recompute, layout in layouts(cfg, world, global_batch, machine.gpus_per_node, space):
        variant = with_recompute(cfg, recompute)
        memory = memory_per_rank(variant, layout)
        prediction = predict_step(variant, layout, machine)
        fits = memory["total"] <= memory_fraction * machine.memory_bytes
        rows.append(
            dict(
                recompute=recompute, layout=layout, cfg=variant, memory=memory,
                prediction=prediction, fits=fits,
            )
        )  # fmt: skip
    rows.sort(key=lambda r: (not r["fits"], r["prediction"]["step_s"]))
    return rows
