"""Mixture-of-experts models trained in parallel against the same model on one process (the
engine without parallelism, the same micro-batches): three optimizer steps, the losses and the
parameters within 1e-6, under DP 2 (every sharding strategy), PP 2 (1F1B) and CP 2 (ring), for a
softmax router with aux_loss, z-loss and gated shared experts beside a dense layer, and a
sigmoid router with expert bias, seq_aux_loss and capacity dropping (over DP and PP only:
dropping counts a rank's own tokens, megatron-core's rule, so CP changes which are dropped)."""

from __future__ import annotations

import pytest

from parallel.state import ParallelState
from tests.distributed import run_ranks
from tests.harness import (
    engine_run,
    full_params,
    model_error,
    opt_config,
    step_errors,
    tiny_config,
)

STEPS, GBS, MBS = 3, 8, 2

ROUTERS = {
    "softmax": dict(
        num_experts=4,
        moe_router_topk=2,
        moe_layer_freq="([0]+[1]*3)",
        moe_ffn_hidden_size=48,
        moe_aux_loss_coeff=[0.01],
        moe_z_loss_coeff=1e-3,
        moe_shared_expert_intermediate_size=32,
        moe_shared_expert_gate=True,
    ),
    "sigmoid": dict(
        num_experts=4,
        moe_router_topk=2,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.05,
        moe_router_load_balancing_type=["seq_aux_loss"],
        moe_aux_loss_coeff=[0.02],
        moe_expert_capacity_factor=1.5,
    ),
}


def _parity(rank, world, layout: str):
    builds = {"dp": {}, "pp": {"pp": 2}, "cp": {"cp": 2}}
    state = ParallelState.build(tp=1, **builds[layout])
    ocfg = opt_config()
    results = []
    for router, options in ROUTERS.items():
        if layout == "cp" and router == "sigmoid":
            continue
        cfg = tiny_config("llama", **options)
        reference, ref_ddps, _ = engine_run(ParallelState.local(), cfg, ocfg, STEPS, GBS, MBS)
        ref_params = full_params(ref_ddps, ParallelState.local())
        initial = full_params(
            engine_run(ParallelState.local(), cfg, ocfg, 0, GBS, MBS)[1], ParallelState.local()
        )
        strategies = ("no_shard", "optim", "optim_grads_params") if layout == "dp" else (None,)
        for sharding in strategies:
            outputs, ddps, _ = engine_run(state, cfg, ocfg, STEPS, GBS, MBS, sharding=sharding)
            errors = model_error(full_params(ddps, state), ref_params, initial)
            results.append(
                {
                    "case": (layout, router, sharding),
                    **errors,
                    **step_errors(outputs, reference),
                }
            )
    return results


@pytest.mark.parametrize("layout", ["dp", "pp", "cp"])
def test_moe_in_parallel_matches_one_process(layout):
    for rank_results in run_ranks(_parity, 2, layout):
        for r in rank_results:
            assert r["moved"] > 0.01, r
            assert r["model"] < 1e-6 and r["worst_tensor"] < 1e-5, r
            assert r["loss_err"] < 1e-6 and r["norm_err"] < 1e-6, r
