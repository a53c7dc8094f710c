"""An MoE layer's experts spread over expert-parallel ranks (tokens exchanged by all-to-all)
against the same layer holding every expert in one process: on 2 and 4 gloo ranks, each rank
routing its own tokens, the outputs, the input gradients, the router's gradient (each rank's
own tokens) and every expert's gradient (the tokens of every rank routed to it) within 1e-5.
Training with it: tests/test_moe_ep_training.py."""

from __future__ import annotations

import pytest
import torch

from engine.config.model import ModelConfig
from engine.model.context import BuildContext
from engine.model.moe.layer import MoELayer
from parallel.state import ParallelState
from tests.distributed import run_ranks

ROUTERS = {
    "softmax, aux_loss, z-loss, shared expert": dict(
        moe_aux_loss_coeff=[0.01], moe_z_loss_coeff=1e-3, moe_shared_expert_intermediate_size=16
    ),
    "sigmoid, capacity 1.0 by position": dict(
        moe_router_score_function="sigmoid",
        moe_expert_capacity_factor=1.0,
        moe_token_drop_policy="position",
    ),
}


def _layer_grads(layer) -> dict[str, torch.Tensor]:
    return {
        getattr(p, "checkpoint_name", n): p.grad.clone()
        for n, p in layer.named_parameters()
        if p.grad is not None
    }


def _compare(rank, world):
    state = ParallelState.build(tp=1, ep=world)
    results = []
    for name, options in ROUTERS.items():
        cfg = ModelConfig(
            num_layers=1,
            hidden_size=16,
            num_attention_heads=2,
            seq_length=6,
            num_experts=8,
            moe_router_topk=2,
            moe_ffn_hidden_size=24,
            swiglu=True,
            add_bias_linear=False,
            **options,
        )
        ctx = BuildContext(
            cfg, seed=7, ep_group=state.ep_group, ep_size=state.ep_size, ep_rank=state.ep_rank
        )
        layer = MoELayer(ctx, 0).train()
        reference = MoELayer(BuildContext(cfg, seed=7), 0).train()
        inputs = [
            torch.randn(6, 3, 16, generator=torch.Generator().manual_seed(r)) for r in range(world)
        ]
        upstream = [
            torch.randn(6, 3, 16, generator=torch.Generator().manual_seed(50 + r))
            for r in range(world)
        ]
        x = inputs[rank].clone().requires_grad_()
        out = layer(x)
        out.backward(upstream[rank])
        mine = _layer_grads(layer)
        expected_out = expected_x = expected_router = None
        for r in range(world):  # every rank's tokens through the one-process layer
            before = _layer_grads(reference)
            xr = inputs[r].clone().requires_grad_()
            o = reference(xr)
            o.backward(upstream[r])
            if r == rank:
                expected_out, expected_x = o.detach(), xr.grad
                after = _layer_grads(reference)
                expected_router = {
                    k: after[k] - before.get(k, 0) for k in after if ".experts." not in k
                }
        expected = _layer_grads(reference)
        experts = {k: v for k, v in mine.items() if ".experts." in k}
        results.append(
            {
                "case": name,
                "out": (out.detach(), expected_out),
                "x_grad": (x.grad, expected_x),
                "router": [(mine[k], v) for k, v in expected_router.items()],
                "experts": [(v, expected[k]) for k, v in experts.items()],
                "local_experts": len(layer.experts.local_experts),
            }
        )
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_layer_matches_one_process(world):
    for rank_results in run_ranks(_compare, world):
        for r in rank_results:
            assert r["local_experts"] == 8 // world, r["case"]
            assert len(r["experts"]) == 2 * (8 // world), r["case"]  # fc1 and fc2 of each
            for got, want in [r["out"], r["x_grad"], *r["router"], *r["experts"]]:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=r["case"])
