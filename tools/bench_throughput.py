"""Single-GPU training throughput: tokens/s, TFLOP/s and MFU of a ~1.3B-parameter GPT step.

Default model: 24 layers, hidden 2048, 16 heads, sequence 2048, vocabulary 32000, bf16,
recompute off (--model 125m / 350m / 1.3b pick GPT-3's shapes), the micro-batch the largest of
--micro-batch-sizes that fits in memory. Runs the engine's real training step for each of
--variants (fused kernels or PyTorch ops, with or without --torch-compile), every attempt in a
fresh process (a variant that fails or runs out of memory is a row, not the end of the run),
and measures a large bf16 matmul in the same run as the practical ceiling.
MFU = model TFLOP/s (engine/monitor/metrics.py counts them) / the datasheet dense bf16 peak
(--peak-tflops, default the device's known peak, e.g. 989 for H100 SXM). Prints a table and
writes JSON. `--tiny` runs a small model on the CPU, to check the script itself.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time

import torch

from engine.cli import run_main as run
from engine.config.arguments import ArgumentParser
from engine.monitor.metrics import device_peak_tflops
from engine.planning.bench_setup import corpus_dataset, sync_device
from engine.planning.bench_variants import MODELS, VARIANTS, bench_variant
from parallel.local_ranks import run_local


def _matmul_tflops(device: torch.device, size: int) -> float:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        sync_device(device)
        start = time.perf_counter()
        a @ b
        sync_device(device)
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times) / 1e12


def _ceiling(rank, world, device, size):
    return _matmul_tflops(torch.device(device), size)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=sorted(MODELS), help="a preset (sets the shape)")
    parser.add_argument("--num-layers", type=int, default=24)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-attention-heads", type=int, default=16)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[16, 12, 8, 6, 4, 2, 1])
    parser.add_argument(
        "--variants", nargs="+", choices=list(VARIANTS), help="default: fused torch (CPU: torch)"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--attempt-timeout", type=float, default=1800)
    parser.add_argument("--matmul-size", type=int, default=8192)
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak (default: known)")
    parser.add_argument("--tiny", action="store_true", help="a small model on the CPU")
    parser.add_argument("--json", default="bench_throughput.json")
    args = parser.parse_args(argv)
    if args.model:
        args.num_layers, args.hidden_size, args.num_attention_heads = MODELS[args.model]
    if args.tiny:
        args.num_layers, args.hidden_size, args.num_attention_heads = 2, 128, 2
        args.seq_length, args.vocab_size, args.micro_batch_sizes = 128, 8192, [2]
        args.warmup, args.steps, args.matmul_size = 1, 2, 512
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    variants = args.variants or (["fused", "torch"] if device == "cuda" else ["torch"])
    peak, name = (
        (args.peak_tflops, "given")
        if args.peak_tflops
        else device_peak_tflops(torch.device(device), "bf16")
    )
    if device == "cuda":
        name = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory() as tmp:
        prefix, tokenizer = corpus_dataset(tmp)
        ceiling = run_local(
            _ceiling, 1, device, args.matmul_size, timeout=600, cpu_only=device == "cpu"
        )[0]
        rows = {v: bench_variant(args, prefix, tokenizer, v, device) for v in variants}
    params = next((r["params"] for r in rows.values() if "params" in r), None)
    print(
        f"device: {name}; torch {torch.__version__}; model "
        + (f"{params / 1e9:.2f}B parameters, " if params else "")
        + f"{args.num_layers} layers, hidden {args.hidden_size}, seq {args.seq_length}, "
        f"{'bf16' if device == 'cuda' else 'fp32'}, recompute off"
    )
    print(
        f"matmul ceiling ({args.matmul_size}^3): {ceiling:.1f} TFLOP/s"
        + (f"; datasheet dense bf16 peak {peak:.0f} TFLOP/s" if peak else "")
    )
    print(
        f"{'variant':16s} {'mbs':>4s} {'step s':>8s} {'tokens/s':>10s} {'TFLOP/s':>8s} "
        f"{'MFU':>6s} {'of matmul':>9s} {'mem GB':>7s}"
    )
    for label, r in rows.items():
        if "error" in r:
            print(f"{label:16s} failed: {r['error']}")
            continue
        r["mfu"] = r["tflops"] / peak if peak else None
        mfu = f"{r['mfu']:6.1%}" if peak else "   n/a"
        mem = f"{r['mem_gb']:7.1f}" if r["mem_gb"] is not None else "    n/a"
        print(
            f"{label:16s} {r['micro_batch']:4d} {r['step_s']:8.3f} {r['tokens_per_s']:10,.0f} "
            f"{r['tflops']:8.1f} {mfu} {r['tflops'] / ceiling:9.1%} {mem}"
        )
    with open(args.json, "w") as f:
        json.dump(
            {
                "device": name,
                "torch": torch.__version__,
                "peak_tflops": peak,
                "matmul_tflops": ceiling,
                "runs": rows,
                "config": vars(args),
            },
            f,
            indent=1,
        )
    return 0


if __name__ == "__main__":
    run(main)
