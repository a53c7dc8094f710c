"""The tensor-parallel linear's backward (parallel/tensor_parallel/linear_function.py), on real gloo
ranks:

- the input-gradient all-reduce / reduce-scatter is issued before the weight-gradient GEMM (so
  the two overlap), recorded from the dispatcher;
- under sequence parallelism only the [s/tp, b, h] shard of the input is saved for backward,
  and the gradients still equal one process's;
- gradient-accumulation fusion puts the same gradients into main_grad with no .grad made for
  the linear weights, while the tied embedding still goes through autograd.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from engine.model import BuildContext, GPTModel
from parallel.data_parallel.ddp import DistributedDataParallel
from parallel.state import ParallelState
from parallel.tensor_parallel.init import normal_init
from parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    all_reduce_partial_grads,
)
from parallel.tensor_parallel.sharding import full_from_local, tp_sharding_of
from tests.distributed import rel_err, run_ranks
from tests.harness import VOCAB, tiny_config


class _OpLog(TorchDispatchMode):
    """The names of the GEMMs and collectives dispatched inside the block, in order."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "mm" in name or "c10d" in name:
            self.ops.append(name.split(".")[1])
        return func(*args, **(kwargs or {}))


def _saved_activation_bytes(module, x) -> tuple[torch.Tensor, int]:
    """module(x), and the bytes of distinct storages it saved for backward, parameters left
    out."""
    params = module.parameters()
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    return out, sum(seen.values())


def _linear_checks(rank, world):
    state = ParallelState.build(tp=2)
    s, b, h, out_features = 8, 2, 16, 24
    torch.manual_seed(0)
    full_x = torch.randn(s, b, h)
    grad_y = torch.randn(s, b, out_features)
    results = {}
    for sp in (False, True):
        lin = ColumnParallelLinear(
            h, out_features, tp_group=state.tp_group, init_method=normal_init(0.1), init_seed=3,
            sequence_parallel=sp,
        )  # fmt: skip
        x = (full_x.chunk(2)[state.tp_rank] if sp else full_x).clone().requires_grad_()
        y, saved = _saved_activation_bytes(lin, x)
        log = _OpLog()
        with log:
            y.backward(grad_y.chunk(2, dim=-1)[state.tp_rank])
        # One process: the same full weight and bias, plain F.linear.
        weight = full_from_local(lin.weight.detach(), tp_sharding_of(lin.weight), state.tp_group)
        bias = full_from_local(lin.bias.detach(), tp_sharding_of(lin.bias), state.tp_group)
        ref_x, ref_w = full_x.clone().requires_grad_(), weight.clone().requires_grad_()
        F.linear(ref_x, ref_w, bias).backward(grad_y)
        ref_grad_x = ref_x.grad.chunk(2)[state.tp_rank] if sp else ref_x.grad
        results[sp] = {
            "ops": log.ops,
            "saved": saved,
            "shard_bytes": full_x.numel() // 2 * 4,
            "full_bytes": full_x.numel() * 4,
            "grad_x": rel_err(x.grad, ref_grad_x),
            "grad_w": rel_err(
                full_from_local(lin.weight.grad, tp_sharding_of(lin.weight), state.tp_group),
                ref_w.grad,
            ),
        }
    return results


def test_tp_linear_overlaps_communication_and_keeps_only_the_shard():
    for result in run_ranks(_linear_checks, 2):
        plain, sp = result[False], result[True]
        # dgrad GEMM, its all-reduce started, then the wgrad GEMM while it is in flight.
        assert plain["ops"] == ["mm", "allreduce_", "mm"], plain["ops"]
        # input gathered again (overlapping the dgrad GEMM), dgrad reduce-scattered, wgrad.
        assert sp["ops"] == ["_allgather_base_", "mm", "_reduce_scatter_base_", "mm"], sp["ops"]
        assert plain["saved"] == plain["full_bytes"]
        assert sp["saved"] == sp["shard_bytes"], (sp["saved"], sp["shard_bytes"])
        for case in (plain, sp):
            assert case["grad_x"] < 1e-6 and case["grad_w"] < 1e-6, case


def _fusion_run(state, fuse: bool):
    cfg = tiny_config("gpt2", num_layers=2, hidden_size=64, num_attention_heads=8)
    ctx = BuildContext(
        cfg,
        tp_group=state.tp_group,
        tp_size=state.tp_size,
        sequence_parallel=True,
        gradient_accumulation_fusion=fuse,
    )
    model = GPTModel(cfg, ctx, tp_rank=state.tp_rank)
    grads_made = {}  # micro-batches in which autograd produced a .grad (hooked before DDP's)
    for name, param in model.named_parameters():
        grads_made[name] = 0
        param.register_post_accumulate_grad_hook(
            lambda p, name=name: grads_made.__setitem__(
                name, grads_made[name] + (p.grad is not None)
            )
        )
    ddp = DistributedDataParallel(model, state.dp_group)
    generator = torch.Generator().manual_seed(0)
    for micro in range(2):
        tokens = torch.randint(0, VOCAB, (2, 17), generator=generator)
        context = ddp.no_sync() if micro == 0 else torch.enable_grad()
        with context:
            ddp(tokens[:, :-1], tokens[:, 1:]).mean().backward()
    ddp.finish_grad_sync()
    all_reduce_partial_grads(ddp.module.parameters(), state.tp_group, grad_attr="main_grad")
    grads = {n: p.main_grad.clone() for n, p in ddp.module.named_parameters()}
    return grads, grads_made


def _fusion_checks(rank, world):
    state = ParallelState.build(tp=2)
    fused, fused_calls = _fusion_run(state, True)
    plain, plain_calls = _fusion_run(state, False)
    return {
        "err": max(rel_err(fused[n], plain[n]) for n in plain),
        "fused_calls": fused_calls,
        "plain_calls": plain_calls,
    }


def test_gradient_accumulation_fusion_fills_main_grad_without_a_grad():
    for result in run_ranks(_fusion_checks, 2):
        assert result["err"] < 1e-6, result["err"]
        suffixes = ("qkv.weight", "proj.weight", "fc1.weight", "fc2.weight")
        linear = [n for n in result["plain_calls"] if n.endswith(suffixes)]
        assert len(linear) == 8
        for name in linear:
            assert result["plain_calls"][name] == 2, name  # one .grad per micro-batch
            assert result["fused_calls"][name] == 0, name  # none: straight into main_grad
        tied = "embedding.word_embeddings.weight"
        assert result["fused_calls"][tied] == result["plain_calls"][tied] == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_bf16_weight_gradients_accumulate_into_fp32_in_one_gemm():
    """Item 14 of the GPU-readiness issue: on CUDA, bf16 weight gradients go into the fp32
    main_grad through one GEMM with an fp32 output (no bf16 product first); the result is the
    float64 reference's within fp32 accumulation, closer than the bf16 product added in."""
    from parallel.tensor_parallel.linear_function import accumulate_in_fp32

    generator = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(512, 4096, device="cuda", generator=generator).bfloat16()
    b = torch.randn(4096, 256, device="cuda", generator=generator).bfloat16()
    start = torch.randn(512, 256, device="cuda", generator=generator)
    main_grad = start.clone()
    assert accumulate_in_fp32(main_grad, a, b)
    reference = start.double() + a.double() @ b.double()
    fused_error = (main_grad.double() - reference).abs().max().item()
    added_error = ((start + (a @ b).float()).double() - reference).abs().max().item()
    assert fused_error < 1e-2 and fused_error < added_error, (fused_error, added_error)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_weights_drawn_on_the_gpu_equal_the_cpu_draw():
    """Item 16: the initialisation hash is bit for bit the same on a GPU, and a slice drawn
    there equals the CPU's draw up to the last bit of the float64 transform."""
    from parallel.tensor_parallel.init import draw_local, hash32
    from parallel.tensor_parallel.sharding import split_sharding

    bits = torch.arange(-(2**20), 2**20, 3, dtype=torch.int32)
    assert torch.equal(hash32(bits.cuda()).cpu(), hash32(bits))
    sharding = split_sharding(0, [4096, 1024, 1024], 1, 2)
    cpu = draw_local((6144, 2048), sharding, normal_init(0.02), 77)
    gpu = draw_local((6144, 2048), sharding, normal_init(0.02), 77, device="cuda")
    assert gpu.is_cuda and torch.allclose(gpu.cpu(), cpu, rtol=1e-6, atol=1e-9)
