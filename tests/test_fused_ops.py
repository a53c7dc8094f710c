"""Fused ops: the PyTorch ops against independent references, the fused autograd glue driven by
the kernel interface's PyTorch implementation (CPU, TP2 on real gloo ranks), the selection
rules and the ranks' agreement on one op set, RoPE's precision on both paths, the CUDA sources
compiling, and (on a GPU) the CUDA kernels against the reference."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig

import pytest
import torch
import torch.nn.functional as F

from engine.errors import ConfigError
from engine.ops import TorchOps, agree_on_ops, select_ops
from engine.ops import reference_kernels as reference
from engine.ops.fused import CSRC, FusedOps
from tests.distributed import rel_err, run_ranks
from tests.test_training import base_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_OPS = TorchOps()
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _random(*shape, dtype=torch.float32, device="cpu", seed=None):
    generator = torch.Generator(device="cpu").manual_seed(
        seed if seed is not None else torch.randint(0, 2**31, ()).item()
    )
    return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)


def _tables(seq, dim, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    angles = torch.cat([angles, angles], dim=-1)[:, None, None, :]
    return angles.cos(), angles.sin()


def test_torch_ops_against_independent_references():
    x = _random(8, 2, 3, 16, seed=1)
    cos, sin = _tables(8, 16)
    # rotate-half RoPE is a complex rotation of (x_j, x_{j+d/2}) pairs by each position's angle
    pairs = torch.complex(x[..., :8].double(), x[..., 8:].double())
    angle = torch.atan2(sin[..., :8], cos[..., :8]).double()
    rotated = pairs * torch.exp(1j * angle)
    expected = torch.cat([rotated.real, rotated.imag], dim=-1)
    assert rel_err(TORCH_OPS.rotary(x, cos, sin), expected) < 1e-6
    h, w = _random(5, 32, seed=2), _random(32, seed=3)
    assert rel_err(TORCH_OPS.rms_norm(h, w, 1e-6), F.rms_norm(h, (32,), w, 1e-6)) < 1e-6
    gate, up = _random(5, 7, seed=4), _random(5, 7, seed=5)
    assert (
        rel_err(TORCH_OPS.swiglu(torch.cat([gate, up], -1)), gate * torch.sigmoid(gate) * up) < 1e-6
    )


def _op_cases(device, dtype):
    """(name, run(ops) -> outputs, inputs needing grads) for every op, on fresh random data."""
    cos, sin = _tables(8, 16)
    cos, sin = cos.to(device), sin.to(device)
    cases = []
    for kind in ("rms", "layer"):
        x = _random(6, 3, 64, dtype=dtype, device=device).requires_grad_(True)
        w = (1 + 0.1 * _random(64, dtype=dtype, device=device)).requires_grad_(True)
        b = (0.1 * _random(64, dtype=dtype, device=device)).requires_grad_(True)
        if kind == "rms":
            cases.append(("rms_norm", lambda ops, x=x, w=w: ops.rms_norm(x, w, 1e-5), [x, w]))
        else:
            cases.append(
                ("layer_norm", lambda ops, x=x, w=w, b=b: ops.layer_norm(x, w, b, 1e-5), [x, w, b])
            )
    # q/k arrive as non-contiguous views of the fused QKV output
    qkv = _random(8, 2, 3, 48, dtype=dtype, device=device).requires_grad_(True)
    cases.append(("rotary", lambda ops: ops.rotary(qkv[..., 16:32], cos, sin), [qkv]))
    h = _random(4, 5, 2 * 24, dtype=dtype, device=device).requires_grad_(True)
    cases.append(("swiglu", lambda ops: ops.swiglu(h), [h]))
    logits = (3 * _random(7, 2, 40, dtype=dtype, device=device)).requires_grad_(True)
    target = torch.randint(0, 37, (7, 2), device=device)
    cases.append(
        (
            "cross_entropy",
            lambda ops: ops.cross_entropy(logits, target, None, 37, return_logsumexp=True),
            [logits],
        )
    )
    return cases


def _compare(fused_ops, device, dtype, tolerance):
    errors = {}
    for name, run, inputs in _op_cases(device, dtype):
        grads, outputs = {}, {}
        for label, ops in (("fused", fused_ops), ("torch", TORCH_OPS)):
            for t in inputs:
                t.grad = None
            out = run(ops)
            out = out if isinstance(out, tuple) else (out,)
            weights = [_random(*o.shape, device=device, seed=i) for i, o in enumerate(out)]
            sum((o.float() * wt).sum() for o, wt in zip(out, weights, strict=True)).backward()
            outputs[label] = [o.detach().double() for o in out]
            grads[label] = [t.grad.double() for t in inputs]
        errors[name] = max(
            [rel_err(a, b) for a, b in zip(outputs["fused"], outputs["torch"], strict=True)]
            + [rel_err(a, b) for a, b in zip(grads["fused"], grads["torch"], strict=True)]
        )
    for name, error in errors.items():
        assert error < tolerance, (name, dtype, errors)
    return errors


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_glue_with_reference_kernels_matches_torch_ops(dtype, tolerance):
    _compare(FusedOps(reference), "cpu", dtype, tolerance)


def _tp2_cross_entropy(rank, world):
    from parallel.state import ParallelState

    state = ParallelState.build(tp=2)
    logits = 3 * _random(6, 2, 64, seed=7)  # vocabulary 64 = 2 x 32, the last 3 ids padding
    target = torch.randint(0, 61, (6, 2), generator=torch.Generator().manual_seed(8))
    local = logits.chunk(2, dim=-1)[state.tp_rank].clone().requires_grad_(True)
    loss, lse = FusedOps(reference).cross_entropy(local, target, state.tp_group, 61, True)
    (loss.sum() + 0.1 * (lse**2).sum()).backward()
    full = logits.clone().requires_grad_(True)
    ref_loss = F.cross_entropy(
        full[..., :61].reshape(-1, 61), target.reshape(-1), reduction="none"
    ).view(6, 2)
    ref_lse = torch.logsumexp(full[..., :61], dim=-1)
    (ref_loss.sum() + 0.1 * (ref_lse**2).sum()).backward()
    ref_grad = full.grad.chunk(2, dim=-1)[state.tp_rank]
    return rel_err(loss, ref_loss), rel_err(lse, ref_lse), rel_err(local.grad, ref_grad)


def test_fused_cross_entropy_glue_over_tp2():
    for errors in run_ranks(_tp2_cross_entropy, 2):
        assert max(errors) < 1e-5, errors


def test_rotary_gives_the_same_numbers_on_both_paths_in_bf16():
    """Both paths rotate in fp32 and cast back once: equal in bf16, forward and backward."""
    cos, sin = _tables(16, 32)
    x = _random(16, 2, 4, 32, dtype=torch.bfloat16, seed=3)
    dy = _random(16, 2, 4, 32, dtype=torch.bfloat16, seed=4)
    results = []
    for ops in (TORCH_OPS, FusedOps(reference)):
        leaf = x.clone().requires_grad_(True)
        out = ops.rotary(leaf, cos, sin)
        out.backward(dy)
        results.append((out.detach(), leaf.grad))
    (torch_out, torch_grad), (fused_out, fused_grad) = results
    assert torch.equal(torch_out, fused_out)
    assert rel_err(torch_grad, fused_grad) < 1e-3  # within one bf16 rounding of each other


def _agreement(rank, world):
    import torch.distributed as dist

    group = dist.group.WORLD
    cpu = torch.device("cpu")
    mixed = agree_on_ops(FusedOps(reference) if rank == 0 else TorchOps(), group, cpu)
    everywhere = agree_on_ops(FusedOps(reference), group, cpu)
    return type(mixed).__name__, type(everywhere).__name__


def test_ranks_agree_on_one_op_set():
    """A rank without the fused kernels makes every rank use the PyTorch ops."""
    assert run_ranks(_agreement, 2) == [("TorchOps", "FusedOps")] * 2


def test_selection_rules():
    cpu = torch.device("cpu")
    assert isinstance(select_ops(cpu), TorchOps)
    assert isinstance(select_ops(cpu, False), TorchOps)
    with pytest.raises(ConfigError, match="--use-fused-kernels needs a CUDA device"):
        select_ops(cpu, True)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--use-fused-kernels"], "--use-fused-kernels needs a CUDA device"),
        (["--transformer-impl", "transformer_engine"], "--transformer-impl transformer_engine"),
    ],
)
def test_unavailable_accelerators_are_one_line_errors(
    dataset_prefix, tokenizer_model, flags, message
):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine.pretrain",
            *base_args(dataset_prefix, tokenizer_model),
            "--device",
            "cpu",
            *flags,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_kernels_compile_with_nvcc(tmp_path):
    for source in ("norms.cu", "rope.cu", "swiglu.cu", "cross_entropy.cu"):
        target = tmp_path / (source + ".o")
        result = subprocess.run(
            [
                "nvcc",
                "-c",
                "-O3",
                "-std=c++17",
                "-arch=sm_90",
                str(CSRC / source),
                "-o",
                str(target),
            ],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stderr
        assert target.stat().st_size > 10_000


@pytest.mark.skipif(
    shutil.which("g++") is None or not os.path.isfile("/usr/local/cuda/include/cuda_runtime.h"),
    reason="needs g++ and the CUDA headers",
)
def test_bindings_compile_against_torch_headers():
    include = os.path.join(os.path.dirname(torch.__file__), "include")
    result = subprocess.run(
        [
            "g++",
            "-std=c++20",
            "-fsyntax-only",
            "-DTORCH_EXTENSION_NAME=tripod_fused",
            f"-I{include}",
            f"-I{include}/torch/csrc/api/include",
            f"-I{sysconfig.get_paths()['include']}",
            "-I/usr/local/cuda/include",
            str(CSRC / "bindings.cpp"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]


# --- on a GPU -------------------------------------------------------------------------------


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_cuda_kernels_match_the_reference(dtype, tolerance):
    """Each kernel against the reference computed in float64 from the same inputs."""
    from engine.ops.fused import build_kernels

    cuda = build_kernels()
    device = "cuda"
    x = _random(257, 1000, dtype=dtype, device=device)
    w, b = _random(1000, dtype=dtype, device=device), _random(1000, dtype=dtype, device=device)
    dy = _random(257, 1000, dtype=dtype, device=device)
    stream = torch.cuda.current_stream().cuda_stream

    def check(name, got, expected):
        got = got if isinstance(got, tuple) else (got,)
        expected = expected if isinstance(expected, tuple) else (expected,)
        for g, e in zip(got, expected, strict=True):  # (the reference is computed on the CPU)
            g, e = g.double().cpu(), e.double().cpu()
            assert torch.isfinite(g).all(), name
            assert rel_err(g, e) < tolerance, (name, rel_err(g, e))

    x64, w64, b64, dy64 = (t.double().cpu() for t in (x, w, b, dy))
    y, rstd = cuda.rms_norm_fwd(x, w, 1e-5, stream)
    check("rms_norm_fwd", y, reference.rms_norm_fwd(x64, w64, 1e-5)[0])
    check(
        "rms_norm_bwd",
        cuda.rms_norm_bwd(dy, x, w, rstd, stream),
        reference.rms_norm_bwd(dy64, x64, w64, rstd.double().cpu()),
    )
    y, mean, rstd = cuda.layer_norm_fwd(x, w, b, 1e-5, stream)
    check("layer_norm_fwd", y, reference.layer_norm_fwd(x64, w64, b64, 1e-5)[0])
    check(
        "layer_norm_bwd",
        cuda.layer_norm_bwd(dy, x, w, mean, rstd, stream),
        reference.layer_norm_bwd(dy64, x64, w64, mean.double().cpu(), rstd.double().cpu()),
    )
    q = _random(128, 4, 8, 64, dtype=dtype, device=device)
    cos, sin = (t.reshape(128, 64).contiguous().to(device) for t in _tables(128, 64))
    for inverse in (False, True):
        check(
            f"rotary inverse={inverse}",
            cuda.rotary(q, cos, sin, inverse, stream),
            reference.rotary(q.double().cpu(), cos.double().cpu(), sin.double().cpu(), inverse),
        )
    h = _random(300, 2 * 700, dtype=dtype, device=device)
    g = _random(300, 700, dtype=dtype, device=device)
    check("swiglu_fwd", cuda.swiglu_fwd(h, stream), reference.swiglu_fwd(h.double().cpu()))
    check(
        "swiglu_bwd",
        cuda.swiglu_bwd(g, h, stream),
        reference.swiglu_bwd(g.double().cpu(), h.double().cpu()),
    )
    logits = 4 * _random(513, 3000, dtype=dtype, device=device)
    target = torch.randint(0, 6000, (513,), device=device)
    for start in (0, 3000):  # this rank's slice of a 6000-word vocabulary, last 100 padding
        l64 = logits.double().cpu()
        row_max = cuda.ce_max(logits, start, 5900, stream)
        check("ce_max", row_max, reference.ce_max(l64, start, 5900))
        stats = cuda.ce_stats(logits, row_max, target, start, 5900, stream)
        check(
            "ce_stats",
            stats,
            reference.ce_stats(l64, row_max.double().cpu(), target.cpu(), start, 5900),
        )
        gl, gs = _random(513, device=device), _random(513, device=device)
        check(
            "ce_bwd",
            cuda.ce_bwd(logits, row_max, stats[0], target, gl, gs, start, 5900, stream),
            reference.ce_bwd(
                l64,
                row_max.double().cpu(),
                stats[0].double().cpu(),
                target.cpu(),
                gl.double().cpu(),
                gs.double().cpu(),
                start,
                5900,
            ),
        )


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_ops_match_torch_ops_on_gpu(dtype, tolerance):
    from engine.ops.fused import build_kernels

    _compare(FusedOps(build_kernels()), "cuda", dtype, tolerance)


class _DtypeStrictKernels:
    """The reference kernels, refusing what the CUDA binding would misread: it reads the
    weight (and bias) in the input's dtype."""

    def __getattr__(self, name):
        return getattr(reference, name)

    @staticmethod
    def _same(x, *others):
        for other in others:
            assert other.dtype == x.dtype, (x.dtype, other.dtype)

    def rms_norm_fwd(self, x, w, eps, stream=0):
        self._same(x, w)
        return reference.rms_norm_fwd(x, w, eps, stream)

    def rms_norm_bwd(self, dy, x, w, rstd, stream=0):
        self._same(x, w, dy)
        return reference.rms_norm_bwd(dy, x, w, rstd, stream)

    def layer_norm_fwd(self, x, w, b, eps, stream=0):
        self._same(x, w, b)
        return reference.layer_norm_fwd(x, w, b, eps, stream)

    def layer_norm_bwd(self, dy, x, w, mean, rstd, stream=0):
        self._same(x, w, dy)
        return reference.layer_norm_bwd(dy, x, w, mean, rstd, stream)


def test_fused_norms_hand_the_kernels_weights_in_the_input_dtype():
    """bf16 activations with fp32 norm weights: the kernels get the weights cast (they would
    read fp32 bytes as bf16), and the weights' gradients come back in fp32."""
    ops = FusedOps(_DtypeStrictKernels())
    x = _random(6, 32, dtype=torch.bfloat16, seed=1).requires_grad_(True)
    w = (1 + 0.1 * _random(32, seed=2)).requires_grad_(True)
    b = (0.1 * _random(32, seed=3)).requires_grad_(True)
    for out in (ops.rms_norm(x, w, 1e-5), ops.layer_norm(x, w, b, 1e-5)):
        assert out.dtype == torch.bfloat16
        out.float().sum().backward()
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    expected = TORCH_OPS.rms_norm(x.detach().float(), w.detach(), 1e-5)
    assert rel_err(ops.rms_norm(x, w, 1e-5).float(), expected) < 2e-2
