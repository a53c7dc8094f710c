"""Measure this machine's rates for the step-time model (`tools/plan.py --calibrate`).

On the CPU a rank is one core (one thread), and these are measured the same way, in fp32 (the
CPU's training dtype):
- GEMM: [2048, s] x [s, s] products for s in 64 .. 1024, FLOP/s by size;
- attention: torch's causal scaled_dot_product_attention forward + backward, in model FLOPs
  (engine/monitor/metrics.py's count: the causal scores in full);
- memory: the engine's own layer forward + backward, less its GEMMs and attention at those
  rates, against the bytes its memory-bound ops move (engine/planning/step_time.py);
- links: all-reduce over 2 gloo ranks at 4 KB .. 16 MB, fitted to latency + bytes / bandwidth;
- the engine's fixed costs (Python, launches, bookkeeping): steps of tiny models measured,
  less what the rates above predict for them, per step, per micro-batch and per layer of a
  micro-batch.
gloo's work shares the rank's core, so nothing it does is taken as hidden behind compute.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace

import torch

from engine.planning.hardware import Link, Machine

GEMM_SIZES = (64, 128, 256, 512, 1024)
GEMM_ROWS = 2048
MESSAGE_BYTES = (4096, 65536, 1 << 20, 4 << 20, 16 << 20)


def median_seconds(fn, repeats: int = 7, warmup: int = 2) -> float:
    """Median wall seconds of fn() over `repeats` calls, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_rates() -> tuple[tuple[float, float], ...]:
    out = []
    for size in GEMM_SIZES:
        a, b = torch.randn(GEMM_ROWS, size), torch.randn(size, size)
        seconds = median_seconds(lambda a=a, b=b: a @ b)
        out.append((float(size), 2 * GEMM_ROWS * size * size / seconds))
    return tuple(out)


def attention_rate(seq: int = 256, heads: int = 4, head_dim: int = 64, batch: int = 2) -> float:
    q, k, v = (torch.randn(batch, heads, seq, head_dim, requires_grad=True) for _ in range(3))

    def step():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()

    return 3 * 4 * batch * seq * seq * heads * head_dim / median_seconds(step)


def memory_rate(gemm, attention: float, hidden: int = 256, seq: int = 256, batch: int = 2):
    """The rate at which the engine's layer does its memory-bound work: the layer's forward +
    backward (GPT-2 style, fp32) measured, less its GEMMs and core attention at the rates
    measured, against the bytes engine/planning/step_time.py counts for it."""
    from engine.config.model import ModelConfig
    from engine.model.context import BuildContext
    from engine.model.layer import TransformerLayer
    from engine.planning.step_time import layer_memory_bytes

    cfg = ModelConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=hidden // 64, seq_length=seq,
        max_position_embeddings=seq, vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    layer = TransformerLayer(BuildContext(cfg), 0).train()
    x = torch.randn(seq, batch, hidden, requires_grad=True)
    seconds = median_seconds(lambda: layer(x).sum().backward())
    machine = Machine("probe", 0, gemm, attention, 1.0, Link(0, 1), Link(0, 1), 1)
    tokens, f = seq * batch, cfg.ffn_size
    products = ((tokens, 3 * hidden, hidden), (tokens, hidden, hidden), (tokens, f, hidden),
                (tokens, hidden, f))  # fmt: skip
    work = 3 * sum(machine.gemm_seconds(*p) for p in products)
    work += 3 * 4 * tokens * seq * hidden / attention
    moved = 3 * layer_memory_bytes(cfg, tokens, tokens, 1, 4)
    return moved / max(seconds - work, 0.05 * seconds)


def _link_times(rank: int, world: int) -> list[tuple[int, float]]:
    import torch.distributed as dist

    out = []
    for nbytes in MESSAGE_BYTES:
        tensor = torch.zeros(nbytes // 4)

        def reduce(tensor=tensor):
            dist.all_reduce(tensor)

        out.append((nbytes, median_seconds(reduce, repeats=9)))
    return out


def fit_link(times: list[tuple[int, float]], ranks: int = 2) -> Link:
    """t = 2 (n - 1) latency + 2 (n - 1) / n bytes / bandwidth, fitted in relative error (least
    squares of (predicted - t) / t), so that small and large messages count alike."""
    import numpy as np

    sizes = np.array([2 * (ranks - 1) / ranks * b for b, _ in times])
    seconds = np.array([t for _, t in times])
    design = np.stack([np.full_like(sizes, 2 * (ranks - 1)), sizes], axis=1) / seconds[:, None]
    (latency, per_byte), *_ = np.linalg.lstsq(design, np.ones_like(seconds), rcond=None)
    return Link(max(float(latency), 0.0), 1 / max(float(per_byte), 1e-15))


def tiny_model_flags(num_layers: int, microbatches: int) -> list[str]:
    """A model small enough that its step is mostly the engine's fixed costs."""
    from engine.planning.measure import mock_gpt_flags

    batch = ["--micro-batch-size", "1", "--global-batch-size", str(microbatches)]
    return mock_gpt_flags(num_layers, 64, 32, 128, heads=2) + batch


OVERHEAD_RUNS = ((2, 1), (2, 8), (8, 8))  # (layers, micro-batches)


def fit_overheads(machine: Machine) -> dict:
    """The engine's fixed costs on this machine: tiny models' measured steps less their
    predicted work, solved for step + (micro-batches) x (per_microbatch + layers x
    per_microbatch_layer)."""
    import numpy as np

    from engine.planning.measure import measure_rank
    from engine.planning.memory import Layout
    from engine.planning.step_time import predict_step
    from engine.pretrain import parse
    from parallel.local_ranks import run_local

    rows, rest = [], []
    for layers, m in OVERHEAD_RUNS:
        flags = tiny_model_flags(layers, m)
        measured = run_local(measure_rank, 1, flags, 3, 15, threads=1)[0]["step_s"]
        cfg = parse(flags).model
        predicted = predict_step(cfg, Layout(num_microbatches=m), machine)["step_s"]
        rows.append([1.0, m, m * layers])
        rest.append(max(measured - predicted, 0.0))
    step, per_microbatch, per_layer = np.linalg.solve(np.array(rows), np.array(rest))
    return {
        "step": max(float(step), 0.0),
        "per_microbatch": max(float(per_microbatch), 0.0),
        "per_microbatch_layer": max(float(per_layer), 0.0),
    }


def calibrate_cpu() -> Machine:
    """This machine's rates, one thread per rank (module docstring)."""
    from parallel.local_ranks import run_local

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gemm, attention = gemm_rates(), attention_rate()
        memory = memory_rate(gemm, attention)
    finally:
        torch.set_num_threads(threads)
    link = fit_link(run_local(_link_times, 2, threads=1)[0])
    cores = os.cpu_count() or 1
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    machine = Machine(
        name=f"cpu ({cores} cores, one per rank)",
        memory_bytes=ram / cores,
        gemm_rates=gemm,
        attention_flops=attention,
        memory_bytes_per_s=memory,
        intra=link,
        inter=link,
        gpus_per_node=cores,
        activation_bytes=4,
        overlaps_comm=False,
    )
    return replace(machine, overheads=fit_overheads(machine))
