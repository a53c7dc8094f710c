"""The planner's mixture-of-experts terms (engine/planning/moe_terms.py) against the engine run for
real on gloo ranks: per-rank parameters, gradients and optimizer state (routed experts sharded
over their expert data-parallel group) within 5% and activations within 10% under EP, ETP, TP
with SP, PP and the sharding strategies, with Adam and with Muon; every MoE layout the planner
proposes passes the engine's checks; tools/plan.py plans a Mixtral-shaped model with EP and
ETP columns and emits flags the engine accepts."""

from __future__ import annotations

import pytest

from engine.planning.memory import Layout
from tests.cli import run_tool
from tests.distributed import run_ranks
from tests.test_plan import LLAMA, RUN, _cpu_machine

MOE = LLAMA + [
    "--num-experts", "4", "--moe-ffn-hidden-size", "96", "--moe-router-topk", "2",
    "--moe-layer-freq", "[0,1,1,1]", "--moe-shared-expert-intermediate-size", "64",
    "--moe-shared-expert-gate", "--moe-token-dispatcher-type", "alltoall",
    "--moe-aux-loss-coeff", "0.01",
]  # fmt: skip
MEMORY_LAYOUTS = [
    (Layout(micro_batch_size=2), "none"),
    (Layout(dp=2, ep=2, strategy="optim", micro_batch_size=2), "none"),
    (Layout(tp=2, ep=2, etp=1, sequence_parallel=True, micro_batch_size=2), "none"),
    (Layout(tp=2, sequence_parallel=True, micro_batch_size=2), "selective"),  # ETP 2
    (Layout(pp=2, dp=2, ep=2, num_microbatches=4, strategy="optim_grads"), "none"),
    # Muon: its weights' state 8 bytes (router, shared and routed experts among them)
    (Layout(dp=2, ep=2, strategy="optim", optimizer="muon", micro_batch_size=2), "none"),
    (Layout(tp=2, ep=2, etp=1, sequence_parallel=True, micro_batch_size=2, optimizer="muon",
            muon_tp_mode="duplicated"), "none"),
]  # fmt: skip


def _flags(layout: Layout, recompute: str):
    from engine.planning.flags import layout_flags
    from engine.planning.search import with_recompute
    from engine.pretrain import parse

    model = MOE + RUN + ["--bf16"]
    cfg = with_recompute(parse(model + ["--micro-batch-size", "1"]).model, recompute)
    return cfg, model + layout_flags(cfg, layout)


def test_moe_memory_per_rank_is_predicted():
    """Measured (seen here): state bytes equal; activations within 4% (the planner assumes
    balanced routing, a rank's experts receive more or fewer rows in a real step)."""
    from engine.planning.measure import measure_rank
    from engine.planning.memory import rank_memory_bytes, rank_parameter_groups

    for layout, recompute in MEMORY_LAYOUTS:
        cfg, flags = _flags(layout, recompute)
        assert rank_parameter_groups(cfg, layout, 0)[1] > 0  # routed experts counted apart
        for measured in run_ranks(measure_rank, layout.world, flags, 0, 1, threads=1):
            predicted = rank_memory_bytes(cfg, layout, measured["pp_rank"])
            case = (layout, recompute, measured, predicted)
            for kind in ("params", "grads", "optimizer"):
                assert measured[kind] == pytest.approx(predicted[kind], rel=0.05), case
            assert measured["activations"] == pytest.approx(predicted["activations"], rel=0.1), case


def test_every_planned_moe_layout_passes_the_engines_checks():
    from engine.config.checks import check_layout_flags
    from engine.config.resolve import resolve
    from engine.planning.flags import layout_flags
    from engine.planning.search import plan
    from engine.pretrain import parse

    base = parse(MOE + RUN + ["--micro-batch-size", "1"]).model
    rows = plan(base, 4, 8, _cpu_machine(1e9), memory_fraction=1.0)
    seen = {(r["layout"].tp, r["layout"].ep, r["layout"].expert_tp) for r in rows}
    assert {(1, 1, 1), (1, 2, 1), (1, 4, 1), (2, 1, 2), (2, 2, 2), (2, 2, 1)} <= seen
    assert all(r["layout"].sequence_parallel for r in rows if r["layout"].tp > 1)
    for row in rows:
        flags = MOE + RUN + layout_flags(row["cfg"], row["layout"])
        assert check_layout_flags(resolve(parse(flags), 4), 4) == row["layout"].dp
        moved = row["prediction"]["parts"]["a2a_comm"]
        assert (moved > 0) == (row["layout"].ep > 1 or row["layout"].expert_tp > 1), row


def test_plan_tool_plans_a_mixtral_shaped_model():
    from engine.config.checks import check_layout_flags
    from engine.config.resolve import resolve
    from engine.pretrain import parse

    model = [
        "--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32",
        "--group-query-attention", "--num-query-groups", "8", "--ffn-hidden-size", "14336",
        "--seq-length", "4096", "--max-position-embeddings", "4096", "--vocab-size", "32000",
        "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
        "--disable-bias-linear", "--untie-embeddings-and-output-weights",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--num-experts", "8",
        "--moe-router-topk", "2",
    ]  # fmt: skip
    result = run_tool(
        "plan.py", *model, "--global-batch-size", "256", "--gpu", "h100", "--gpus", "16",
        "--emit-flags", "--top", "3",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[1].split()[5:7] == ["EP", "ETP"]
    emitted = lines[-1].split()
    assert "--expert-model-parallel-size" in emitted
    check_layout_flags(resolve(parse(model + ["--train-iters", "1"] + emitted), 16), 16)
