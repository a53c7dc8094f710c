"""Pipeline parallelism: GPipe, 1F1B and interleaved 1F1B give the loss and every gradient of
the PP=1 model; 1F1B agrees with torch.distributed.pipelining; activation memory per schedule;
the full 3D layout (TP2 x PP2 x DP2, SP, each sharding strategy, virtual stages,
recomputation) over 5 optimizer steps."""

from __future__ import annotations

import pytest
import torch

from engine.errors import ConfigError
from parallel.pipeline.layout import stage_layers
from parallel.pipeline.schedules import peak_in_flight
from parallel.state import ParallelState
from tests.distributed import rel_err, run_ranks
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


def _pp_parity(rank, world, pp):
    state = ParallelState.build(tp=1, pp=pp)
    out = []
    for tied in (True, False):
        cfg = tiny_config("gpt2" if tied else "llama", num_layers=8)
        for m in (1, 4, 8):
            tokens = global_batch(m, MBS * m * state.dp_size, cfg.seq_length)
            ref_loss, ref_grads = reference_grads(cfg, tokens)
            for kind in ("gpipe", "1f1b", "1f1b-uneven", "interleaved", "interleaved-overlap"):
                interleaved = kind.startswith("interleaved")
                if interleaved and m % pp:
                    continue
                stats = {}
                # uneven: the first stage 1 layer fewer, the last 1 more (PP 2: 3 and 5;
                # PP 4: 1, 2, 2 and 3), as --decoder-first/last-pipeline-num-layers set them
                uneven = kind == "1f1b-uneven"
                first, last = (8 // pp - 1, 8 // pp + 1) if uneven else (None, None)
                losses, grads = engine_grads(
                    state,
                    cfg,
                    tokens,
                    MBS,
                    schedule_kind="interleaved" if interleaved else kind.split("-")[0],
                    virtual_size=2 if interleaved else 1,
                    stats=stats,
                    overlap_p2p=kind == "interleaved-overlap",
                    first_stage_layers=first,
                    last_stage_layers=last,
                )

                errors = compare_params(grads, ref_grads)
                loss = None
                if losses:
                    mean = torch.stack(losses).mean().reshape(1)
                    if state.dp_group is not None:
                        torch.distributed.all_reduce(mean, group=state.dp_group)
                        mean /= state.dp_size
                    loss = abs(mean.item() - ref_loss) / ref_loss
                out.append(
                    {
                        "case": (tied, m, kind),
                        "grad": max(errors.values()),
                        "params": len(errors),
                        "layers": sorted(
                            {int(n.split(".")[1]) for n in errors if n.startswith("layers.")}
                        ),
                        "loss": loss,
                        "peak": stats["peak_held"],
                        "output_bytes": stats["peak_output_bytes"],
                        "overlapped": stats.get("computes_overlapped"),
                        "rank": state.pp_rank,
                    }
                )
    return out


@pytest.mark.parametrize("pp", [2, 4])
def test_schedules_match_unpipelined_model(pp):
    results = run_ranks(_pp_parity, 4, pp, timeout=400)
    for rank_results in results:
        # 2 embeddings x 3 micro-batch counts x 5 schedules, minus m=1 interleaved (2 kinds)
        assert len(rank_results) == 26
        for r in rank_results:
            tied, m, kind = r["case"]
            assert r["grad"] < 1e-5, r
            assert r["params"] > 0
            if r["rank"] == pp - 1:
                assert r["loss"] is not None and r["loss"] < 1e-6, r
            # Sent outputs are freed: one element each is left (a held [s, b, h] output would
            # be 16 x 2 x 32 x 4 bytes); the last stage holds its scalar losses.
            assert r["output_bytes"] <= r["peak"] * 4, r
            # the planner's count (parallel/pipeline/schedules.py:peak_in_flight) is what ran
            schedule, v = (
                ("interleaved", 2) if kind.startswith("interleaved") else (kind.split("-")[0], 1)
            )
            assert r["peak"] == peak_in_flight(schedule, pp, r["rank"], m, v), r
            if kind == "1f1b-uneven":  # each stage holds the layers the flags give it
                counts = {2: [3, 5], 4: [1, 2, 2, 3]}[pp]
                start = sum(counts[: r["rank"]])
                assert r["layers"] == list(range(start, start + counts[r["rank"]])), r
            if kind == "gpipe":
                assert r["peak"] == m, r
            elif kind.startswith("1f1b"):
                assert r["peak"] == min(pp - r["rank"], m) <= pp, r
            elif kind == "interleaved":
                assert r["overlapped"] == 0, r  # blocking: every transfer done before compute
            elif m > pp:  # with overlap, steady-state computes run while transfers are in flight
                assert r["overlapped"] >= m, r
    assert all(r["loss"] is not None for r in results[-1])  # rank 3 is a last stage


def _torch_pipelining(rank, world):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from engine.model.builder import build_model_chunks
    from parallel.tensor_parallel.layers import vocab_parallel_cross_entropy

    state = ParallelState.build(tp=1, pp=world)
    cfg = tiny_config("llama", num_layers=8)
    m = 8
    tokens = global_batch(3, MBS * m, cfg.seq_length)
    _, ours = engine_grads(state, cfg, tokens, MBS, schedule_kind="1f1b")

    model = build_model_chunks(cfg, state)[0]

    class Stage(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            if self.inner.pre_process:
                return self.inner(tokens=x)
            return self.inner(hidden=x)

    def loss_fn(logits, target):  # logits [s, b, V] from the last stage
        return vocab_parallel_cross_entropy(logits, target.t(), None, cfg.vocab_size).mean()

    stage = PipelineStage(Stage(model), state.pp_rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, m, loss_fn=loss_fn)
    if state.is_first_stage:
        schedule.step(tokens[:, :-1])
    elif state.is_last_stage:
        schedule.step(target=tokens[:, 1:])
    else:
        schedule.step()
    theirs = {getattr(p, "checkpoint_name", n): p.grad for n, p in model.named_parameters()}
    return max(rel_err(ours[n], theirs[n]) for n in theirs), len(theirs)


def test_1f1b_agrees_with_torch_pipelining():
    for error, count in run_ranks(_torch_pipelining, 4):
        assert count > 0 and error < 1e-5, error


# (style, sharding strategy, virtual stages, full recomputation)
THREE_D_CASES = [
    ("gpt2", "optim", 1, False),
    ("llama", "optim", 1, False),
    ("gpt2", "optim_grads", 1, False),
    ("llama", "optim_grads", 2, False),
    ("llama", "optim_grads_params", 1, False),
    ("gpt2", "optim_grads_params", 2, True),
]


def _three_d(rank, world):
    state = ParallelState.build(tp=2, pp=2)
    out, references = [], {}  # one reference run per configuration
    for style, sharding, virtual, recompute in THREE_D_CASES:
        extra = {}
        if recompute:
            extra = dict(
                recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
            )
        cfg, ocfg = tiny_config(style, num_layers=4, **extra), opt_config()
        if (style, recompute) not in references:
            references[style, recompute] = reference_run(cfg, ocfg, 5, 8)
        ref_losses, _, ref_params, initial = references[style, recompute]
        outputs, ddps, _ = engine_run(
            state,
            cfg,
            ocfg,
            5,
            8,
            2,
            sharding=sharding,
            overlap=True,
            sequence_parallel=True,
            virtual_size=virtual,
        )
        losses = [o.loss for o in outputs]
        out.append(
            {
                "case": (style, sharding, virtual, recompute),
                **model_error(full_params(ddps, state), ref_params, initial),
                "loss": None
                if losses[0] is None
                else max(abs(a - b) / b for a, b in zip(losses, ref_losses, strict=True)),
            }
        )
    return out


def test_3d_tp2_pp2_dp2_with_sp_and_every_sharding_strategy_matches_single_process():
    """TP2 x PP2 x DP2 with SP and overlapped reductions, under the distributed optimizer
    (optim), sharded gradients (optim_grads) and sharded parameters (optim_grads_params), with
    virtual stages and full recomputation among the cases."""
    results = run_ranks(_three_d, 8, timeout=400)
    for rank, rank_results in enumerate(results):
        for r in rank_results:
            assert r["moved"] > 0.02, r
            assert r["model"] < 1e-6 and r["worst_tensor"] < 1e-5, r
            if rank >= 4:  # last pipeline stage
                assert r["loss"] < 1e-6, r


def test_stage_layers_even_uneven_and_interleaved():
    assert stage_layers(8, 2, 0) == [[0, 1, 2, 3]]
    assert stage_layers(8, 2, 1) == [[4, 5, 6, 7]]
    assert stage_layers(8, 2, 0, virtual_size=2) == [[0, 1], [4, 5]]
    assert stage_layers(8, 2, 1, virtual_size=2) == [[2, 3], [6, 7]]
    assert stage_layers(10, 4, 0, first_stage_layers=1, last_stage_layers=3) == [[0]]
    assert stage_layers(10, 4, 1, first_stage_layers=1, last_stage_layers=3) == [[1, 2, 3]]
    assert stage_layers(10, 4, 3, first_stage_layers=1, last_stage_layers=3) == [[7, 8, 9]]
    with pytest.raises(ConfigError, match="num-layers 6 is not divisible"):
        stage_layers(6, 4, 0)
    with pytest.raises(ConfigError, match="do not split evenly"):
        stage_layers(10, 4, 0, first_stage_layers=2)


def _interleaved_needs_multiple(rank, world):
    state = ParallelState.build(tp=1, pp=2)
    cfg = tiny_config("gpt2", num_layers=4)
    try:
        engine_grads(
            state,
            cfg,
            global_batch(0, 6, cfg.seq_length),
            2,
            schedule_kind="interleaved",
            virtual_size=2,
        )
    except ValueError as err:
        return str(err)
    return None


def test_interleaving_needs_microbatches_multiple_of_pp():
    for message in run_ranks(_interleaved_needs_multiple, 2):
        assert "multiple of pipeline-model-parallel-size 2" in message
