"""The MoE layer's own pieces: its output against the dense formula (every expert on every
token, weighted by the router's probabilities; GELU experts with biases, whose down-projection
bias is scaled by the probability too), and --moe-grouped-gemm's grouped GEMM against the
loop over experts (output and every gradient; on a GPU too, in bf16)."""

from __future__ import annotations

import pytest
import torch

from engine.config.model import ModelConfig
from engine.model.context import BuildContext
from engine.model.moe.experts import grouped_gemm_fits
from engine.model.moe.layer import MoELayer
from tests.distributed import run_ranks


def _layer(**options) -> MoELayer:
    cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8, **options)
    cfg.validate()
    return MoELayer(BuildContext(cfg, seed=5), 0).train()


def test_output_is_the_probability_weighted_sum_of_the_experts():
    layer = _layer(num_experts=4, moe_ffn_hidden_size=24, bias_gelu_fusion=False)
    assert layer.experts.local_experts[0].linear_fc2.bias is not None  # GELU with biases
    x = torch.randn(8, 3, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        probs, _ = layer.router(x)
        tokens = x.reshape(-1, 16)
        expected = sum(
            probs[:, e : e + 1] * expert(tokens)
            for e, expert in enumerate(layer.experts.local_experts)
        )
        got = layer(x).reshape(-1, 16)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _assert_same_forward_and_backward(reference: MoELayer, other: MoELayer, x: torch.Tensor):
    """The two layers' outputs, input gradients and every weight's gradient within 1e-5."""
    upstream = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    outputs, grads = [], []
    for layer in (reference, other):
        inputs = x.clone().requires_grad_()
        out = layer(inputs)
        out.backward(upstream)
        outputs.append(out.detach())
        grads.append([inputs.grad] + [p.grad for p in layer.parameters()])
    torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-6)
    assert len(grads[1]) == len(grads[0]) > 8
    for a, b in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_grouped_gemm_equals_the_loop_over_experts():
    options = dict(num_experts=4, moe_ffn_hidden_size=32, swiglu=True, add_bias_linear=False)
    loop, grouped = _layer(**options), _layer(moe_grouped_gemm=True, **options)
    x = torch.randn(8, 4, 16, generator=torch.Generator().manual_seed(2))
    assert grouped_gemm_fits(grouped.experts, x.reshape(-1, 16))  # the grouped kernel runs
    _assert_same_forward_and_backward(loop, grouped, x)


@pytest.mark.parametrize(
    "options",
    [
        dict(swiglu=False, add_bias_linear=True),  # GELU experts with biases
        dict(swiglu=False, squared_relu=True, add_bias_linear=False),
        dict(swiglu=True, add_bias_linear=False, moe_ffn_hidden_size=30),  # unaligned rows
    ],
    ids=["gelu-biases", "squared-relu", "unaligned"],
)
def test_the_batched_path_equals_the_loop_over_experts(options):
    """--moe-grouped-gemm where torch's grouped GEMM does not run (biases, squared ReLU,
    rows that are not 16-byte multiples): one batched GEMM per projection over the padded
    rows, the same outputs and gradients as the loop."""
    options = dict(num_experts=4, moe_ffn_hidden_size=32) | options
    loop, batched = _layer(**options), _layer(moe_grouped_gemm=True, **options)
    x = torch.randn(8, 4, 16, generator=torch.Generator().manual_seed(2))
    assert not grouped_gemm_fits(batched.experts, x.reshape(-1, 16))
    _assert_same_forward_and_backward(loop, batched, x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_grouped_gemm_on_the_gpu_equals_the_loop_over_experts():
    """torch._grouped_mm on CUDA in bf16 (what --moe-grouped-gemm runs on GPUs) against the loop
    over experts, forward and backward, within bf16's rounding."""

    def build(grouped: bool) -> MoELayer:
        cfg = ModelConfig(
            num_layers=1,
            hidden_size=64,
            num_attention_heads=2,
            seq_length=16,
            num_experts=8,
            moe_ffn_hidden_size=128,
            swiglu=True,
            add_bias_linear=False,
            moe_grouped_gemm=grouped,
        )
        ctx = BuildContext(cfg, seed=5, device="cuda", params_dtype=torch.bfloat16)
        return MoELayer(ctx, 0).train()

    loop, grouped = build(False), build(True)
    generator = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(16, 4, 64, device="cuda", dtype=torch.bfloat16, generator=generator)
    assert grouped_gemm_fits(grouped.experts, x.reshape(-1, 64))
    upstream = torch.randn_like(x)
    results = []
    for layer in (loop, grouped):
        inputs = x.clone().requires_grad_()
        out = layer(inputs)
        out.backward(upstream)
        results.append([out.detach(), inputs.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_model_flops_count_the_active_experts():
    from engine.monitor.metrics import model_flops_per_token

    shape = dict(num_layers=4, hidden_size=16, num_attention_heads=2, seq_length=8, swiglu=True)
    dense = ModelConfig(ffn_hidden_size=24, **shape)
    moe = ModelConfig(
        num_experts=8,
        moe_router_topk=2,
        moe_ffn_hidden_size=12,  # 2 active experts of 12: the dense model's 24
        moe_layer_freq="2",  # layers 0 and 2
        ffn_hidden_size=24,
        **shape,
    )
    router = 3 * 2 * 2 * 16 * 8  # training x forward's 2 FLOPs x 2 MoE layers x h x E
    assert model_flops_per_token(moe, 64) - model_flops_per_token(dense, 64) == router


def _gathers_waited(rank, world):
    from parallel.data_parallel.ddp import DistributedDataParallel
    from parallel.state import ParallelState

    state = ParallelState.build(tp=1)
    layer = _layer(num_experts=4, moe_ffn_hidden_size=32, swiglu=True, add_bias_linear=False)
    ddp = DistributedDataParallel(
        layer,
        state.dp_cp_group,
        bucket_size=600,  # an expert's weights fill buckets of their own
        sharding="optim",
        overlap_param_gather=True,
    )
    ddp.start_param_sync()
    experts = layer.experts
    expert_buckets = {ddp.bucket_of[p] for p in experts.parameters()}
    in_flight = sum(b.param_work is not None for b in expert_buckets)
    for hook in experts._forward_pre_hooks.values():  # what runs before the grouped GEMM
        hook(experts, ())
    return in_flight, sum(b.param_work is not None for b in expert_buckets), len(expert_buckets)


def test_the_grouped_gemm_waits_for_its_weights_gathers():
    """--overlap-param-gather: the experts' own forward (the grouped GEMM reads their weights
    without calling them) waits for the gathers of every bucket holding them."""
    for in_flight, after, buckets in run_ranks(_gathers_waited, 2):
        assert buckets > 1 and in_flight == buckets and after == 0
