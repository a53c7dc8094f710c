"""Expert-parallel training against the same model on one process (the engine without
parallelism, the same micro-batches): three optimizer steps, the losses, gradient norms and
every parameter within 1e-6, with the experts spread over 2 or 4 ranks folded out of data,
context, tensor and pipeline parallelism, the experts' buffers reduced and sharded over their own
data-parallel group:

- DP 2 x EP 2 under every sharding strategy (softmax top-2 with shared experts, sigmoid with
  expert bias and capacity, Sinkhorn top-1 with full recomputation); TP 2 x EP 2 also with
  selective recomputation of the MoE layers, shared experts, norms and dense MLP; DP 4 x EP 2
  (an expert data-parallel group of 2) with overlapped reductions and gathers; DP 4 x EP 4;
- PP 2 x DP 2 x EP 2 (1F1B, GPipe, zero-bubble zb-h1, uneven stages of 1 and 3 layers; and
  interleaved, zb-v and dualpipe-v with 2 virtual stages); CP 2 x EP 2 (each --cp-comm-type);
- TP 2 with sequence parallelism and whole experts (EP 1, EP 2 folded over TP, TP 2 x DP 2 x
  EP 2; GELU experts with biases too);
- each expert split over 2 ranks (expert tensor parallelism: TP 2 with ETP 2, Megatron-LM's
  default; ETP 2 over DP 2; TP 2 x DP 2 x EP 2 x ETP 2 with sharded parameters).

Mutation tests: reducing the experts' gradients over DP x CP (the dense group) instead of their
own group fails the comparison (below); so does counting a whole expert's bias toward the norm
on one tensor-parallel rank only (the GELU case; tried by hand)."""

from __future__ import annotations

import pickle

import pytest

from parallel.state import ParallelState
from tests.distributed import run_ranks
from tests.harness import (
    compare_params,
    engine_run,
    full_params,
    model_error,
    opt_config,
    step_errors,
    tiny_config,
)
from tests.test_moe_parallel import ROUTERS

STEPS, GBS, MBS = 3, 8, 2
# (model style, MoE options): the two routers, and GELU experts with biases (a replicated
# bias of a whole expert counts toward the norm on every tensor-parallel rank)
CASES = {
    "softmax": ("llama", ROUTERS["softmax"]),
    "sigmoid": ("llama", ROUTERS["sigmoid"]),
    "gelu-biases": (
        "gpt2",
        dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_aux_loss_coeff=[0.01]),
    ),
    # selective recomputation of named parts: each MoE layer rerun in backward, its all-to-all
    # included, and its shared experts, the norms and the dense MLP
    "recompute-modules": (
        "llama",
        ROUTERS["softmax"]
        | dict(
            recompute_granularity="selective",
            recompute_modules=["moe", "shared_experts", "layernorm", "mlp", "core_attn"],
        ),
    ),
    # top-1 by Sinkhorn, every layer recomputed in backward (the exchanges run again there)
    "sinkhorn-top1-recompute": (
        "llama",
        dict(
            num_experts=4,
            moe_router_topk=1,
            moe_router_load_balancing_type=["sinkhorn"],
            moe_ffn_hidden_size=48,
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=1,
        ),
    ),
}

# (name, world, ParallelState.build options, the runs: engine_run options)
LAYOUTS = {
    "dp2-ep2": (
        2,
        dict(ep=2),
        # overlapped: an expert data-parallel group of one rank reduces nothing asynchronously
        [dict(sharding=s, overlap=True) for s in ("no_shard", "optim")]
        + [dict(sharding=s) for s in ("optim_grads", "optim_grads_params")],
    ),
    "dp4-ep2": (
        4,
        dict(ep=2),
        [
            dict(sharding="no_shard", overlap=True),
            dict(sharding="optim", overlap=True, overlap_param_gather=True),
            dict(sharding="optim_grads_params"),
        ],
    ),
    "dp4-ep4": (4, dict(ep=4), [dict(sharding="optim"), dict(sharding="no_shard")]),
    "pp2-dp2-ep2": (
        4,
        dict(pp=2, ep=2),
        [
            dict(sharding="no_shard"),
            dict(sharding="optim"),
            dict(sharding="optim", schedule_kind="gpipe"),
            dict(sharding="optim", schedule_kind="zb-h1"),  # weight gradients deferred
            dict(sharding="no_shard", first_stage_layers=1),  # uneven stages: 1 and 3 layers
        ],
    ),
    "pp2-virtual-ep2": (  # interleaved 1F1B, 2 chunks per stage
        4,
        dict(pp=2, ep=2),
        [
            dict(sharding=s, schedule_kind="interleaved", virtual_size=2)
            for s in ("optim", "no_shard")
        ]
        + [  # (micro-batches of 1: zb-v needs 3 a step at PP 2, dualpipe-v 4)
            dict(sharding="optim", schedule_kind=k, virtual_size=2, micro_batch=1)
            for k in ("zb-v", "dualpipe-v")
        ],
    ),
    "cp2-ep2": (
        2,
        dict(cp=2, ep=2),
        [dict(sharding=s) for s in ("optim", "no_shard")]
        + [dict(sharding="optim", cp_comm_type=(kind,)) for kind in ("a2a", "allgather")],
    ),
    # tensor and sequence parallelism: each TP rank routes its part of the sequence to whole
    # experts (expert tensor-parallel size 1), folded over TP too
    "tp2-ep1": (
        2,
        dict(tp=2, ep=1, etp=1),
        [dict(sharding=s, sequence_parallel=True) for s in ("no_shard", "optim")],
    ),
    "tp2-ep2": (
        2,
        dict(tp=2, ep=2, etp=1),
        [dict(sharding=s, sequence_parallel=True) for s in ("optim_grads_params", "no_shard")],
    ),
    "tp2-dp2-ep2": (
        4,
        dict(tp=2, ep=2, etp=1),
        [
            dict(sharding="optim", sequence_parallel=True, overlap=True),
            dict(sharding="no_shard", sequence_parallel=True),
        ],
    ),
    # expert tensor parallelism: each expert split over 2 ranks, which gather its rows
    "tp2-etp2": (  # Megatron-LM's default: the experts split as the dense layers
        2,
        dict(tp=2, ep=1),
        [dict(sharding=s, sequence_parallel=True) for s in ("no_shard", "optim")],
    ),
    "dp2-etp2": (2, dict(ep=1, etp=2), [dict(sharding=s) for s in ("optim_grads", "no_shard")]),
    "tp2-dp2-ep2-etp2": (
        4,
        dict(tp=2, ep=2, etp=2),
        [dict(sharding=s, sequence_parallel=True) for s in ("optim_grads_params", "no_shard")],
    ),
}


def _micro_batch_sizes(layout: str) -> set[int]:
    return {options.get("micro_batch", MBS) for options in LAYOUTS[layout][2]}


def _one_process_runs(rank, world, wanted: list[tuple[str, int]]):
    """The runs each layout is compared with, on one process: for (router, micro-batch size)
    its step outputs, final parameters and first gradients (the balancing losses are per
    micro-batch); for (router, 0) the initial parameters."""
    local, ocfg = ParallelState.local(), opt_config()
    found = {}
    for router, mbs in wanted:
        style, options = CASES[router]
        cfg = tiny_config(style, **options)
        if mbs == 0:
            found[router, 0] = full_params(engine_run(local, cfg, ocfg, 0, GBS, MBS)[1], local)
            continue
        grads = {}
        reference, ddps, _ = engine_run(local, cfg, ocfg, STEPS, GBS, mbs, first_grads=grads)
        found[router, mbs] = (reference, full_params(ddps, local), grads)
    return found


@pytest.fixture(scope="module")
def one_process():
    """references(layout, routers): the one-process runs they need, each run once in this
    module (on one forked rank, one thread, as the layouts' ranks run), pickled (tensors in a
    forked process's arguments would each take a file descriptor)."""
    found = {}

    def references(layout: str, routers) -> dict:
        wanted = {(r, mbs) for r in routers for mbs in {0, *_micro_batch_sizes(layout)}}
        if missing := sorted(wanted - found.keys()):
            found.update(run_ranks(_one_process_runs, 1, missing)[0])
        return pickle.dumps({key: found[key] for key in wanted})

    return references


def _parity(rank, world, layout: str, routers, references: bytes, mutate: bool = False):
    references = pickle.loads(references)
    _, build, runs = LAYOUTS[layout]
    state = ParallelState.build(**{"tp": 1} | build)
    if mutate:  # the experts' gradients reduced over DP x CP: other experts' added in
        state.expert_dp_group = state.dp_cp_group
        runs = runs[:1]
    ocfg = opt_config()
    results = []
    for router in routers:
        style, options = CASES[router]
        cfg = tiny_config(style, **options)
        initial = references[router, 0]
        for options in runs:
            options = dict(options)
            mbs = options.pop("micro_batch", MBS)
            reference, ref_params, ref_grads = references[router, mbs]
            grads = {} if options["sharding"] == "no_shard" else None
            outputs, ddps, _ = engine_run(
                state, cfg, ocfg, STEPS, GBS, mbs, **options, first_grads=grads
            )
            got = full_params(ddps, state)
            errors = model_error(got, ref_params, initial)
            if grads is not None:  # every gradient of the first step
                errors["grad_err"] = max(compare_params(grads, ref_grads).values())
                errors["grads"] = len(grads)
            experts = [n for n in got if ".local_experts." in n]
            results.append(
                {
                    "case": (layout, router, options),
                    **errors,
                    "experts": sorted({n.split(".local_experts.")[1][0] for n in experts}),
                    "routers": sum(n.endswith(".router.weight") for n in got),
                    "expert_buffers": sum(b.is_expert for d in ddps for b in d.buffers),
                    **step_errors(outputs, reference),
                }
            )
    return results


@pytest.mark.parametrize(
    "layout, routers",
    [
        ("dp2-ep2", ("softmax", "sigmoid", "sinkhorn-top1-recompute")),
        ("dp4-ep2", ("softmax",)),
        ("dp4-ep4", ("sigmoid",)),
        ("pp2-dp2-ep2", ("softmax",)),
        ("pp2-virtual-ep2", ("sigmoid",)),
        ("cp2-ep2", ("softmax",)),
        ("tp2-ep1", ("softmax", "gelu-biases")),
        ("tp2-ep2", ("softmax", "recompute-modules")),
        ("tp2-dp2-ep2", ("softmax",)),
        ("tp2-etp2", ("softmax",)),
        ("dp2-etp2", ("softmax",)),
        ("tp2-dp2-ep2-etp2", ("softmax",)),
    ],
)
def test_expert_parallel_training_matches_one_process(layout, routers, one_process):
    world, build, _ = LAYOUTS[layout]
    ep = build["ep"]
    references = one_process(layout, routers)
    results = [r for rank in run_ranks(_parity, world, layout, routers, references) for r in rank]
    assert any("grad_err" in r for r in results)  # each layout checks every gradient
    for r in results:
        assert r["moved"] > 0.01, r
        assert r["model"] < 1e-6 and r["worst_tensor"] < 1e-5, r
        assert r["loss_err"] < 1e-6 and r["norm_err"] < 1e-6, r
        if "grad_err" in r:  # every gradient (no_shard runs: unsharded)
            assert r["grads"] >= 5 and r["grad_err"] < 1e-5, r
        # only this rank's experts (a first stage of 1 dense layer has none)
        assert len(r["experts"]) == (4 // ep if r["routers"] else 0), r
        # experts apart from the dense parameters unless each is split as they are
        tp = build.get("tp", 1)
        apart = ep > 1 or build.get("etp", tp) != tp
        assert (r["expert_buffers"] >= 1) == (apart and r["routers"] > 0), r


def test_experts_reduced_over_the_dense_group_fail_the_comparison(one_process):
    references = one_process("dp2-ep2", ("softmax",))
    for rank_results in run_ranks(_parity, 2, "dp2-ep2", ("softmax",), references, True):
        (r,) = rank_results
        assert r["worst_tensor"] > 1e-3, r


def _low_precision(rank, world):
    import torch

    state = ParallelState.build(tp=1, ep=2)
    cfg = tiny_config("llama", **ROUTERS["softmax"])
    # (an initial loss scale that fits fp16 from the first step: none is skipped)
    ocfg = opt_config(lr=3e-3, initial_loss_scale=2.0**12)
    runs = {"fp32": dict(), "bf16": dict(dtype=torch.bfloat16)}
    runs["fp16"] = dict(dtype=torch.float16, fp16=True)
    out = {}
    for name, options in runs.items():
        outputs, _, _ = engine_run(
            state, cfg, ocfg, 20, GBS, MBS, sharding="optim", repeat_batch=True, **options
        )
        out[name] = ([o.loss for o in outputs], [o.updated for o in outputs])
    return out


def test_bf16_and_fp16_experts_track_fp32():
    """DP 2 x EP 2 with the distributed optimizer: bf16 parameters, and fp16 with its dynamic
    loss scale, take every step and follow the fp32 loss curve within 2% while the model
    memorises a batch."""
    found = run_ranks(_low_precision, 2)[0]
    fp32 = found["fp32"][0]
    assert fp32[-1] < fp32[0] - 1.0  # it learns
    for name in ("bf16", "fp16"):
        losses, updated = found[name]
        assert all(updated), name
        for a, b in zip(fp32, losses, strict=True):
            assert abs(a - b) / a < 0.02, (name, a, b)
