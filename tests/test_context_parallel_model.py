"""Context parallelism through the whole model, against one process: the loss and every
gradient of a Llama-style model with the sequence split over CP 2 and 4 ranks (ring,
all-to-all and all-gather attention; with and without a sliding window and grouped-query
attention), combined with TP2 + SP, PP2 (1F1B and virtual stages) and DP2; then optimizer
steps under every sharding strategy and a TP2 x CP2 x PP2 layout."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallel.state import ParallelState
from tests.distributed import run_ranks
from tests.harness import (
    compare_params,
    engine_grads,
    engine_run,
    full_params,
    global_batch,
    model_error,
    opt_config,
    reference_grads,
    reference_run,
    tiny_config,
)

MBS = 2
COMM_TYPES = ("p2p", "a2a", "allgather")


def _config(window: int | None, gqa: bool, **overrides):
    heads = dict(num_attention_heads=8, num_query_groups=4 if gqa else 8)
    window_size = None if window is None else f"({window}, 0)"
    return tiny_config(
        "llama", group_query_attention=gqa, window_size=window_size, **heads, **overrides
    )


def _mean_loss(losses, state) -> float | None:
    """The global batch's mean loss from this rank's micro-batch shares (last stage only)."""
    total = torch.stack(losses).mean().reshape(1) if losses else torch.zeros(1)
    if state.dp_cp_group is not None:
        dist.all_reduce(total, group=state.dp_cp_group)
    return total.item() / state.dp_size if losses else None


def _grads(rank, world, tp, pp, cp, cases):
    state = ParallelState.build(tp=tp, pp=pp, cp=cp)
    out = []
    for comm_type, window, gqa, virtual in cases:
        cfg = _config(window, gqa)
        tokens = global_batch(7, MBS * 4 * state.dp_size, cfg.seq_length)
        ref_loss, ref_grads = reference_grads(cfg, tokens)
        losses, grads = engine_grads(
            state,
            cfg,
            tokens,
            MBS,
            cp_comm_type=(comm_type,),
            sequence_parallel=tp > 1,
            virtual_size=virtual,
            schedule_kind="interleaved" if virtual > 1 else None,
        )
        loss = _mean_loss(losses, state)
        out.append(
            {
                "case": (comm_type, window, gqa, virtual),
                "grad": max(compare_params(grads, ref_grads).values()),
                "params": len(grads),
                "loss": None if loss is None else abs(loss - ref_loss) / ref_loss,
            }
        )
    return out


def _every_type(windows=(None, 5), gqas=(True, False), virtual=1):
    return [(c, w, g, virtual) for c in COMM_TYPES for w in windows for g in gqas]


LAYOUTS = {
    "cp2": (2, 1, 1, 2, _every_type()),
    "cp4": (4, 1, 1, 4, _every_type()),
    "tp2_sp_cp2": (4, 2, 1, 2, _every_type(gqas=(True,))),
    "pp2_cp2": (4, 1, 2, 2, _every_type(gqas=(True,)) + _every_type((5,), (True,), 2)),
    "dp2_cp2": (4, 1, 1, 2, _every_type(gqas=(True,))),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_loss_and_gradients_match_one_process(layout):
    world, tp, pp, cp, cases = LAYOUTS[layout]
    results = run_ranks(_grads, world, tp, pp, cp, cases, timeout=400)
    for rank_results in results:
        assert [r["case"] for r in rank_results] == cases
        for r in rank_results:
            assert r["params"] > 0, r
            assert r["grad"] < 1e-5, r
            if r["loss"] is not None:
                assert r["loss"] < 1e-6, r
    assert any(r["loss"] is not None for rank_results in results for r in rank_results)


TRAINING_CASES = [
    # (tp, pp, cp, sharding, comm type, recompute)
    (1, 1, 2, "no_shard", "p2p", False),
    (1, 1, 2, "optim", "a2a", True),
    (1, 1, 2, "optim_grads", "allgather", False),
    (1, 1, 2, "optim_grads_params", "p2p", True),
]


def _training(rank, world, cases):
    out, references = [], {}  # one reference run per configuration
    for tp, pp, cp, sharding, comm_type, recompute in cases:
        state = ParallelState.build(tp=tp, pp=pp, cp=cp)
        extra = {}
        if recompute:
            extra = dict(
                recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
            )
        cfg, ocfg = _config(5, True, **extra), opt_config()
        if recompute not in references:
            references[recompute] = reference_run(cfg, ocfg, 3, 8)
        ref_losses, _, ref_params, initial = references[recompute]
        outputs, ddps, _ = engine_run(
            state,
            cfg,
            ocfg,
            3,
            8,
            2,
            sharding=sharding,
            overlap=True,
            sequence_parallel=tp > 1,
            cp_comm_type=(comm_type,),
        )
        out.append(
            {
                "case": (tp, pp, cp, sharding, comm_type, recompute),
                **model_error(full_params(ddps, state), ref_params, initial),
                "loss": max(abs(o.loss - r) / r for o, r in zip(outputs, ref_losses, strict=True)),
            }
        )
    return out


def _check_training(results):
    for rank_results in results:
        for r in rank_results:
            assert r["moved"] > 0.02, r
            assert r["model"] < 1e-6 and r["worst_tensor"] < 1e-5, r
            assert r["loss"] < 1e-6, r


def test_training_steps_under_every_sharding_strategy_match_one_process():
    """DP2 x CP2: three optimizer steps with gradients (and, sharded, optimizer state,
    gradients and parameters) over the four DP x CP ranks, overlapped reductions,
    recomputation in two cases."""
    _check_training(run_ranks(_training, 4, TRAINING_CASES, timeout=400))


def test_training_steps_tp2_cp2_pp2_match_one_process():
    case = [(2, 2, 2, "optim", "p2p", False)]
    _check_training(run_ranks(_training, 8, case, timeout=400))


SHAPE = [
    *("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"),
    *("--seq-length", "24", "--max-position-embeddings", "24", "--micro-batch-size", "2"),
    *("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"),
    *("--train-iters", "4", "--attention-dropout", "0.0"),
]


@pytest.mark.parametrize(
    "world, extra, message",
    [
        (6, ["--context-parallel-size", "4"], "world size 6 is not divisible by tensor-model-"),
        (
            4,
            ["--context-parallel-size", "4", "--seq-length", "20"],
            "--seq-length 20 is not divisible by 2 x --context-parallel-size 4",
        ),
        (
            8,
            ["--context-parallel-size", "2", "--tensor-model-parallel-size", "4"]
            + ["--sequence-parallel", "--seq-length", "12", "--max-position-embeddings", "12"],
            "--seq-length 12 / --context-parallel-size 2 is not divisible by --tensor-model",
        ),
        (2, ["--context-parallel-size", "2", "--attention-dropout", "0.1"], "--attention-drop"),
        (
            2,
            ["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--group-query-attention"],
            "--cp-comm-type a2a: key/value groups (--num-query-groups) 1 / --tensor-model",
        ),
        (2, ["--cp-comm-type", "a2a+p2p"], "--cp-comm-type a2a+p2p: hierarchical context"),
        (2, ["--cp-comm-type", "p2p", "a2a", "p2p"], "--cp-comm-type: 3 values for 2 layers"),
    ],
)
def test_context_parallel_flags_are_checked_in_one_line(world, extra, message):
    from engine.errors import ConfigError
    from engine.pretrain import parse
    from engine.train.preflight import prepare

    cfg = parse(SHAPE + extra)
    with pytest.raises(ConfigError) as error:
        prepare(cfg, world)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_context_parallel_flags_that_fit_pass():
    from engine.pretrain import parse
    from engine.train.preflight import prepare

    for world, extra in [
        (2, ["--context-parallel-size", "2"]),
        (4, ["--context-parallel-size", "2", "--cp-comm-type", "a2a", "allgather"]),
        (4, ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2"]),
    ]:
        prepare(parse(SHAPE + extra), world)
