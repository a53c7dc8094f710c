"""The fused kernels against eager PyTorch and torch.compile: parity and speed, op by op.

Each op (RMSNorm, LayerNorm, RoPE, SwiGLU, vocabulary cross-entropy) runs forward and backward
on shapes of a ~1.3B model's step (8 x 2048 tokens, hidden 2048, 16 heads of 128, FFN 5632,
vocabulary 32000) in bf16, three ways: the fused kernels (csrc/fused), the engine's PyTorch ops
(eager) and the same PyTorch ops under torch.compile. Parity is the relative error of each
way's outputs and input gradients against the PyTorch ops in fp32 on the same inputs; speed is
the median of CUDA-event-timed forward+backward passes. Prints a table and writes JSON.
`--tiny` runs small shapes on the CPU with the kernels' PyTorch reference implementation (the
fused autograd glue, no CUDA), to check the script itself.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import torch

from engine.cli import run_main
from engine.config.arguments import ArgumentParser
from engine.ops import TorchOps
from engine.ops.fused import FusedOps

Case = tuple[str, Callable, list[torch.Tensor]]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _cases(tokens: int, hidden: int, heads: int, ffn: int, vocab: int, device, dtype) -> list:
    """(name, run(ops, inputs) -> outputs, inputs) on fresh random data."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(device=device, dtype=dtype)

    head_dim = hidden // heads
    seq = min(tokens, 2048)
    batch = tokens // seq
    angles = torch.outer(
        torch.arange(seq, dtype=torch.float32),
        1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)),
    )
    angles = torch.cat([angles, angles], -1)[:, None, None, :].to(device)
    cos, sin = angles.cos(), angles.sin()
    target = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    return [
        (
            "rms_norm",
            lambda ops, x, w: ops.rms_norm(x, w, 1e-5),
            [rand(tokens, hidden), rand(hidden)],
        ),
        (
            "layer_norm",
            lambda ops, x, w, b: ops.layer_norm(x, w, b, 1e-5),
            [rand(tokens, hidden), rand(hidden), rand(hidden)],
        ),
        ("rotary", lambda ops, q: ops.rotary(q, cos, sin), [rand(seq, batch, heads, head_dim)]),
        ("swiglu", lambda ops, h: ops.swiglu(h), [rand(tokens, 2 * ffn)]),
        (
            "cross_entropy",
            lambda ops, logits: ops.cross_entropy(logits, target, None, vocab),
            [rand(tokens, vocab, scale=3.0)],
        ),
    ]


def _forward_backward(run, ops, inputs):
    leaves = [t.detach().requires_grad_(True) for t in inputs]
    out = run(ops, *leaves)
    out.float().sum().backward()
    return out.detach(), [t.grad for t in leaves]


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn, device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


class _Compiled:
    """TorchOps' functions under torch.compile, with the same method names."""

    def __init__(self):
        ops = TorchOps()
        self.rms_norm = torch.compile(ops.rms_norm)
        self.layer_norm = torch.compile(ops.layer_norm)
        self.rotary = torch.compile(ops.rotary)
        self.swiglu = torch.compile(ops.swiglu)
        self.cross_entropy = torch.compile(ops.cross_entropy)


def measure(args) -> list[dict]:
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.tiny:
        from engine.ops import reference_kernels

        fused = FusedOps(reference_kernels)
    else:
        from engine.ops.fused import build_kernels

        fused = FusedOps(build_kernels())
    ways = {"fused": fused, "eager": TorchOps()}
    if not args.no_compile:
        ways["compiled"] = _Compiled()
    rows = []
    shapes = (args.tokens, args.hidden, args.heads, args.ffn, args.vocab)
    for name, run, inputs in _cases(*shapes, device, dtype):
        reference, ref_grads = _forward_backward(run, TorchOps(), [t.float() for t in inputs])
        row: dict = {"op": name}
        for label, ops in ways.items():
            try:
                out, grads = _forward_backward(run, ops, inputs)
                row[f"{label}_err"] = max(
                    [_rel_err(out, reference)]
                    + [_rel_err(a, b) for a, b in zip(grads, ref_grads, strict=False)]
                )
                row[f"{label}_ms"] = _time_ms(
                    lambda ops=ops, run=run, inputs=inputs: _forward_backward(run, ops, inputs),
                    device,
                    args.warmup,
                    args.repeats,
                )
            except Exception as err:  # noqa: BLE001 - a failing way is a row's finding
                row[f"{label}_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        rows.append(row)
    return rows


def _cell(row: dict, label: str) -> str:
    if f"{label}_error" in row:
        return f"{'failed':>20s}"
    return f"{row[f'{label}_ms']:9.3f} {row[f'{label}_err']:10.2e}"


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=8 * 2048)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    parser.add_argument("--tiny", action="store_true", help="small shapes on the CPU")
    parser.add_argument("--json", default="bench_fused_ops.json")
    args = parser.parse_args(argv)
    if args.tiny:
        args.tokens, args.hidden, args.heads, args.ffn, args.vocab = 64, 64, 4, 96, 500
        args.warmup, args.repeats = 1, 2
    elif not torch.cuda.is_available():
        print("bench_fused_ops: no CUDA device; run with --tiny on the CPU")
        return 2
    rows = measure(args)
    ways = ["fused", "eager"] + ([] if args.no_compile else ["compiled"])
    device = "cpu (reference kernels)" if args.tiny else torch.cuda.get_device_name()
    print(f"device: {device}; torch {torch.__version__}; forward+backward, median ms")
    print(f"{'op':14s} " + " ".join(f"{w + ' ms':>9s} {w[:5] + ' err':>10s}" for w in ways))
    for row in rows:
        print(f"{row['op']:14s} " + " ".join(_cell(row, w) for w in ways))
    for row in rows:
        for w in ways:
            if f"{w}_error" in row:
                print(f"{row['op']} {w}: {row[f'{w}_error']}")
    with open(args.json, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    run_main(main)
