"""Tensor and sequence parallelism against a single-process model built from the same seed:
loss, logits and every gradient (gathered back to full shape), for TP 1/2/4, SP on and off,
GPT-2 and Llama styles with grouped-query attention. Plus torch's own tensor parallelism as an
independent reference, recomputation with dropout, and the parameter-count helper."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from engine.config.model import ModelConfig
from engine.errors import ConfigError
from engine.model import BuildContext, GPTModel, parameter_counts
from parallel.random import model_parallel_seed
from parallel.state import ParallelState
from parallel.tensor_parallel.init import normal_init
from parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    all_reduce_partial_grads,
)
from parallel.tensor_parallel.sharding import full_from_local, tp_sharding_of
from tests.distributed import rel_err, run_ranks
from tests.harness import VOCAB, tiny_config

# VOCAB (300) pads to 384 at TP 1 and 512 at TP 2/4: padding must not change anything.


def model_config(style: str, **overrides) -> ModelConfig:
    """The shared tiny model at a size where TP 4 splits the 4 query groups of 8 heads."""
    sizes = dict(num_layers=2, hidden_size=64, num_attention_heads=8)
    if style.startswith("llama"):
        sizes.update(group_query_attention=True, num_query_groups=4, qk_layernorm=True)
    if style == "llama-across-heads":  # OLMoE's query/key norms: one over all heads, TP-summed
        sizes.update(qk_layernorm_across_heads=True)
    return tiny_config(style.split("-")[0], **{**sizes, **overrides})


def build(cfg, state: ParallelState | None, sp: bool = False, tracker=None) -> GPTModel:
    if state is None or state.tp_group is None:
        ctx = BuildContext(cfg, tracker=tracker)
        return GPTModel(cfg, ctx)
    ctx = BuildContext(
        cfg, tp_group=state.tp_group, tp_size=state.tp_size, sequence_parallel=sp, tracker=tracker
    )
    return GPTModel(cfg, ctx, tp_rank=state.tp_rank)


def run_step(model, tokens, labels, tp_group):
    loss = model(tokens, labels).mean()
    loss.backward()
    all_reduce_partial_grads(model.parameters(), tp_group)
    with torch.no_grad():
        logits = model.full_logits(model(tokens))
    return loss.detach(), logits


def full_grad(param, tp_group):
    return full_from_local(param.grad, tp_sharding_of(param), tp_group)


def _parity(rank, world):
    out = []
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (2, 17), generator=generator)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    for tp in (1, 2, 4):
        state = ParallelState.build(tp=tp)
        for style in ("gpt2", "llama", "llama-across-heads"):
            for sp in (False, True) if tp > 1 else (False,):
                cfg = model_config(style)
                ref = build(cfg, None)
                ref_loss, ref_logits = run_step(ref, inputs, labels, None)
                model = build(cfg, state, sp)
                loss, logits = run_step(model, inputs, labels, state.tp_group)
                ref_params = dict(ref.named_parameters())
                grads = {}
                for name, param in model.named_parameters():
                    full = full_grad(param, state.tp_group)
                    expected = ref_params[name].grad
                    if "word_embeddings" in name or "output_layer" in name:
                        assert full[VOCAB:].abs().max() == 0, f"{name}: padding rows got gradient"
                        full, expected = full[:VOCAB], expected[:VOCAB]
                    assert full.shape == expected.shape, name
                    grads[name] = rel_err(full, expected)
                counts = parameter_counts(model)
                global_split = sum(
                    sum(
                        torch.Size(p.global_shape).numel()
                        for p in tp_sharding_of(q).pieces(q.shape)
                    )
                    for q in model.parameters()
                    if not tp_sharding_of(q).replicated
                )
                out.append(
                    {
                        "case": (tp, style, sp),
                        "loss": rel_err(loss, ref_loss),
                        "logits": rel_err(logits, ref_logits),
                        "grads": grads,
                        "counts_ok": counts["tp_split"] * tp == global_split
                        and counts["replicated"] == parameter_counts(ref)["replicated"],
                    }
                )
    return out


def test_tp_sp_parity_with_single_process():
    results = run_ranks(_parity, 4, timeout=400)
    cases = {r["case"] for r in results[0]}
    assert len(cases) == 15  # tp1 x 3 styles + tp2/tp4 x 3 styles x SP on/off
    for rank_results in results:
        for r in rank_results:
            assert r["loss"] < 1e-5 and r["logits"] < 1e-5, r
            worst = max(r["grads"].items(), key=lambda kv: kv[1])
            assert worst[1] < 1e-5, (r["case"], worst)
            assert r["counts_ok"], r["case"]
            assert len(r["grads"]) >= 14


def _torch_tp_reference(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_mesh = mesh["tp"]
    state = ParallelState.build(tp=2)
    h, f, s, b = 16, 32, 8, 3
    errors = []
    for sp in (False, True):
        ours_fc1 = ColumnParallelLinear(
            h, f, tp_group=state.tp_group, init_method=_normal, init_seed=1, sequence_parallel=sp
        )
        ours_fc2 = RowParallelLinear(
            f, h, tp_group=state.tp_group, init_method=_normal, init_seed=2, sequence_parallel=sp
        )
        theirs = torch.nn.Sequential(torch.nn.Linear(h, f), torch.nn.GELU(), torch.nn.Linear(f, h))
        with torch.no_grad():
            for layer, ours in ((theirs[0], ours_fc1), (theirs[2], ours_fc2)):
                layer.weight.copy_(
                    full_from_local(ours.weight, tp_sharding_of(ours.weight), state.tp_group)
                )
                layer.bias.copy_(
                    full_from_local(ours.bias, tp_sharding_of(ours.bias), state.tp_group)
                )
        if sp:
            plan = {
                "0": ColwiseParallel(input_layouts=Shard(0)),
                "2": RowwiseParallel(output_layouts=Shard(0)),
            }
        else:
            plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        parallelize_module(theirs, tp_mesh, plan)
        x = torch.randn(s, b, h, generator=torch.Generator().manual_seed(5))
        x_local = x.chunk(2)[state.tp_rank] if sp else x
        x_ours = x_local.clone().requires_grad_(True)
        x_theirs = x_local.clone().requires_grad_(True)
        y_ours = ours_fc2(torch.nn.functional.gelu(ours_fc1(x_ours)))
        y_theirs = theirs(x_theirs)
        (y_ours * y_ours).sum().backward()
        (y_theirs * y_theirs).sum().backward()
        grad_fc1 = theirs[0].weight.grad
        grad_fc1 = grad_fc1.to_local() if hasattr(grad_fc1, "to_local") else grad_fc1
        bias2 = ours_fc2.bias.grad.clone()
        if sp:
            dist.all_reduce(bias2, group=state.tp_group)
        bias2_theirs = theirs[2].bias.grad
        bias2_theirs = (
            bias2_theirs.full_tensor() if hasattr(bias2_theirs, "full_tensor") else bias2_theirs
        )
        errors.append(
            {
                "sp": sp,
                "out": rel_err(y_ours, y_theirs),
                "grad_in": rel_err(x_ours.grad, x_theirs.grad),
                "grad_fc1": rel_err(ours_fc1.weight.grad, grad_fc1),
                "grad_bias2": rel_err(bias2, bias2_theirs),
            }
        )
    return errors


_normal = normal_init(0.2)


def test_agrees_with_torch_tensor_parallel():
    for rank_errors in run_ranks(_torch_tp_reference, 4):
        for errors in rank_errors:
            for key, value in errors.items():
                if key != "sp":
                    assert value < 1e-5, errors


def _recompute(rank, world):
    state = ParallelState.build(tp=2)
    out = {}
    for style in ("gpt2", "llama"):
        grads = {}
        for mode in ("none", "full-uniform", "full-block", "selective"):
            cfg = model_config(style, hidden_dropout=0.2, attention_dropout=0.2, num_layers=3)
            if mode.startswith("full"):
                cfg = dataclasses.replace(
                    cfg,
                    recompute_granularity="full",
                    recompute_method=mode.split("-")[1],
                    recompute_num_layers=2,
                )
            elif mode == "selective":
                cfg = dataclasses.replace(cfg, recompute_granularity="selective")
            tracker = model_parallel_seed(1234, state.tp_rank, 0)
            model = build(cfg, state, sp=True, tracker=tracker)
            tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(1))
            loss = model(tokens[:, :-1], tokens[:, 1:]).mean()
            loss.backward()
            grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
            if mode == "none":
                model.eval()
                out[f"{style}-dropout-active"] = (
                    abs(model(tokens[:, :-1], tokens[:, 1:]).mean().item() - loss.item()) > 1e-4
                )
        out[style] = {
            mode: max(rel_err(grads[mode][n], grads["none"][n]) for n in grads["none"])
            for mode in grads
        }
    return out


def test_recomputation_gives_identical_gradients_with_dropout():
    for result in run_ranks(_recompute, 2):
        for style in ("gpt2", "llama"):
            assert result[f"{style}-dropout-active"]
            for mode, err in result[style].items():
                assert err == 0.0, (style, mode, err)


@pytest.mark.parametrize(
    "change, tp, sp, message",
    [
        (
            {"num_attention_heads": 6, "hidden_size": 60},
            4,
            False,
            "num-attention-heads 6 is not divisible by tensor-model-parallel-size 4",
        ),
        (
            {"group_query_attention": True, "num_query_groups": 2},
            4,
            False,
            "num-query-groups 2 is not divisible by tensor-model-parallel-size 4",
        ),
        (
            {"group_query_attention": True, "num_query_groups": 3},
            1,
            False,
            "num-attention-heads 8 is not divisible by num-query-groups 3",
        ),
        ({"hidden_size": 60}, 1, False, "hidden-size 60 is not divisible by num-attention-heads 8"),
        (
            {"seq_length": 18},
            4,
            True,
            "seq-length 18 is not divisible by tensor-model-parallel-size 4",
        ),
        ({"recompute_granularity": "full"}, 1, False, "needs --recompute-method"),
    ],
)
def test_invalid_shapes_give_clear_errors(change, tp, sp, message):
    cfg = model_config("gpt2", **change)
    with pytest.raises(ConfigError, match=message):
        cfg.validate(tp, sp)


def test_vocab_padding():
    cfg = model_config("gpt2")
    assert cfg.padded_vocab_size(1) == 384 and cfg.padded_vocab_size(2) == 512
    cfg = dataclasses.replace(cfg, vocab_size=512)
    assert cfg.padded_vocab_size(4) == 512
