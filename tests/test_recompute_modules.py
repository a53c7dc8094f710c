"""Selective recomputation of named parts (--recompute-modules, megatron-core's choices, and
--moe-layer-recompute): each part rerun in backward leaves the loss and every gradient as
they are without recomputation, and the graph keeps fewer bytes for backward (the part really
is rerun); refused combinations are one line. Under expert parallelism the rerun MoE layer
repeats its all-to-all in backward: tests/test_moe_ep_training.py's "recompute-modules" case."""

from __future__ import annotations

import pytest
import torch

from engine.config.model import ModelConfig
from engine.errors import ConfigError
from engine.model import BuildContext, GPTModel
from engine.planning.saved_activations import PeakSavedBytes
from tests.distributed import rel_err
from tests.harness import tiny_config
from tests.test_moe_parallel import ROUTERS

# a dense first layer, then MoE layers with gated shared experts, experts by the grouped GEMM
MOE = ROUTERS["softmax"] | dict(moe_grouped_gemm=True)


def _step(cfg: ModelConfig, tokens: torch.Tensor):
    """(loss, gradients by name, the most bytes saved for backward) of one forward/backward."""
    model = GPTModel(cfg, BuildContext(cfg, seed=7)).train()
    params = list(model.parameters())
    with PeakSavedBytes(params) as saved:
        loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, saved.peak


@pytest.mark.parametrize(
    "options",
    [
        dict(recompute_modules=["core_attn"]),
        dict(recompute_modules=["mlp"]),
        dict(recompute_modules=["layernorm"]),
        dict(recompute_modules=["moe"]),
        dict(recompute_modules=["moe_act"]),
        dict(recompute_modules=["shared_experts"]),
        dict(recompute_modules=["core_attn", "mlp", "layernorm", "moe_act", "shared_experts"]),
        dict(recompute_granularity=None, moe_layer_recompute=True),
    ],
    ids=lambda o: "+".join(o.get("recompute_modules") or ["moe-layer-recompute"]),
)
def test_each_recomputed_part_gives_the_same_gradients_and_keeps_less(options):
    tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(3))
    plain = tiny_config("llama", **MOE)
    recomputed = tiny_config("llama", **MOE | {"recompute_granularity": "selective"} | options)
    assert recomputed.selective_modules
    loss, grads, kept = _step(plain, tokens)
    loss_r, grads_r, kept_r = _step(recomputed, tokens)
    assert torch.equal(loss_r, loss)
    assert grads.keys() == grads_r.keys() and len(grads) > 30
    # (equal but for the order gradients from a rerun part are added in: the norms' within 4e-7)
    for name, grad in grads.items():
        assert rel_err(grads_r[name], grad) < 1e-6, name
    assert kept_r < kept, (kept_r, kept)


def test_recompute_modules_follow_megatron_cores_rules():
    base = tiny_config("llama", **MOE)
    assert base.selective_modules == frozenset()
    selective = ModelConfig(**base.__dict__ | {"recompute_granularity": "selective"})
    assert selective.selective_modules == {"core_attn"}  # the default
    layer = ModelConfig(**base.__dict__ | {"moe_layer_recompute": True})
    assert layer.selective_modules == {"core_attn", "moe"}  # selective, and moe added
    for options, problem in (
        (dict(moe_layer_recompute=True, recompute_granularity="full", recompute_method="uniform",
              recompute_num_layers=1), "--moe-layer-recompute with --recompute-granularity full"),
        (dict(recompute_granularity="selective", recompute_modules=["moe_act"],
              moe_grouped_gemm=False), "moe_act needs --moe-grouped-gemm"),
        (dict(recompute_granularity="selective", recompute_modules=["shared_experts"],
              moe_shared_expert_overlap=True, moe_token_dispatcher_type="alltoall"),
         "shared_experts cannot work with --moe-shared-expert-overlap"),
    ):  # fmt: skip
        with pytest.raises(ConfigError, match=problem) as err:
            ModelConfig(**base.__dict__ | options).validate()
        assert "\n" not in str(err.value)
