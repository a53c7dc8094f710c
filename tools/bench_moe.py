"""Mixture-of-experts speed on CPU gloo, all measured in one run, one thread per rank:

1. MoE against dense: a model whose MLPs are E experts with top-k routing (EP 1, one rank)
   against the same model with dense MLPs of k x the expert size (the same active parameters):
   seconds per step, tokens/s, model-state bytes per rank (parameters, gradients, Adam) and
   peak memory per rank (the state plus the most activation bytes autograd held at once over
   a step, engine/planning/saved_activations.PeakSavedBytes, as the planner's tests count
   it); the goal is MoE within 1.3x dense's step time.
2. Expert-parallel weak scaling: the per-rank batch fixed, EP N (folded over DP N, the experts
   E / N per rank, tokens exchanged by all-to-all) against N one-rank EP 1 runs side by side
   (what sharing the machine costs without any exchange); efficiency = side by side / EP N,
   the goal >= 85%.
3. One MoE layer, forward and backward: the router, the dispatch (grouping rows by expert and
   adding the outputs back) and the experts, each timed alone on the same tokens: the
   dispatch's share of the layer; and the experts as one grouped GEMM (--moe-grouped-gemm,
   `torch._grouped_mm`) against the loop over experts.

Each configuration is launched --repeats times, interleaved, and the median taken. Prints the
tables and writes JSON.
"""

from __future__ import annotations

import json
import statistics
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.cli import run_main as run
from engine.config.arguments import ArgumentParser
from engine.model.builder import build_model_chunks
from engine.planning.bench_setup import bench_model_config
from engine.planning.bench_steps import bench_optimizer, timed_steps
from engine.planning.calibrate import median_seconds
from engine.planning.saved_activations import PeakSavedBytes
from engine.planning.state_memory import held_state_bytes
from parallel.data_parallel.ddp import DistributedDataParallel
from parallel.local_ranks import run_local
from parallel.state import ParallelState


def _config(args, moe: bool, grouped: bool = True):
    extra = dict(swiglu=True, add_bias_linear=False)
    if moe:
        extra |= dict(
            num_experts=args.num_experts,
            moe_router_topk=args.topk,
            moe_ffn_hidden_size=args.expert_ffn,
            moe_aux_loss_coeff=[0.01],
            moe_grouped_gemm=grouped,
        )
    else:
        extra |= dict(ffn_hidden_size=args.topk * args.expert_ffn)
    return bench_model_config(args, **extra)


def _train(rank, world, args, moe: bool, ep: int):
    """Median seconds per step, model-state bytes and peak bytes (state + activations held)
    of this rank."""
    state = ParallelState.build(tp=1, ep=ep)
    cfg = _config(args, moe)
    chunks = build_model_chunks(cfg, state)
    experts = {"expert_dp_group": state.expert_dp_group} if ep > 1 else {}
    ddps = [DistributedDataParallel(c, state.dp_group, **experts) for c in chunks]
    optimizer, scheduler = bench_optimizer(ddps, state, experts_apart=ep > 1)
    params = [p for c in chunks for p in c.parameters()]
    with PeakSavedBytes(params) as saved:
        times = timed_steps(
            ddps, optimizer, scheduler, state, warmup=args.warmup, steps=args.steps,
            micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
            vocab_size=args.vocab_size, seed=rank,
        )  # fmt: skip
    held = sum(held_state_bytes(ddps, optimizer).values())
    return statistics.median(times), held, held + saved.peak


def _layer(rank, world, args, grouped: bool):
    """Seconds of one MoE layer's forward and backward, and of its router and experts alone."""
    from engine.model.context import BuildContext
    from engine.model.moe.dispatch import permute
    from engine.model.moe.layer import MoELayer

    cfg = _config(args, True, grouped)
    layer = MoELayer(BuildContext(cfg, seed=1), 0).train()
    generator = torch.Generator().manual_seed(0)
    shape = (args.seq_length, args.micro_batch_size, args.hidden_size)
    x = torch.randn(shape, generator=generator).requires_grad_()
    flat = x.detach().reshape(-1, args.hidden_size)
    with torch.no_grad():
        probs, routing_map = layer.router(x.detach())
    rows, row_probs, permutation = permute(flat, routing_map, probs)
    rows.requires_grad_()
    grad_out = torch.randn(shape, generator=generator)  # dense gradients, as in training
    grad_rows = torch.randn(rows.shape, generator=generator)

    def whole():
        layer(x).backward(grad_out)

    def router():
        scores, _ = layer.router(x)
        scores.backward(torch.ones_like(scores))

    def experts():
        layer.experts(rows, permutation.counts, row_probs).backward(grad_rows)

    return {
        "layer": median_seconds(whole, args.steps, warmup=1),
        "router": median_seconds(router, args.steps, warmup=1),
        "experts": median_seconds(experts, args.steps, warmup=1),
    }


def _median_rows(runs: dict[str, list]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in runs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--expert-ffn", type=int, default=256, help="each expert's hidden size")
    parser.add_argument("--ep", default="2,4", help="expert-parallel sizes to scale to")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="launches of each configuration")
    parser.add_argument("--json", default="bench_moe.json")
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.ep.split(",") if n]

    steps: dict[str, list] = {"dense": [], "MoE EP 1": []}
    state_bytes: dict[str, int] = {}
    peak_bytes: dict[str, int] = {}
    scaling: dict[str, list] = {}
    layer: dict[str, list] = {}
    for _ in range(args.repeats):
        for name, moe in (("dense", False), ("MoE EP 1", True)):
            seconds, held, peak = run_local(_train, 1, args, moe, 1, timeout=1800)[0]
            steps[name].append(seconds)
            state_bytes[name], peak_bytes[name] = held, peak
        for ep in sizes:
            with ThreadPoolExecutor(ep) as pool:
                alone = [pool.submit(run_local, _train, 1, args, True, 1) for _ in range(ep)]
                side = max(f.result()[0][0] for f in alone)
            scaling.setdefault(f"{ep} x EP 1 side by side", []).append(side)
            results = run_local(_train, ep, args, True, ep, timeout=1800)
            scaling.setdefault(f"EP {ep} (DP {ep})", []).append(max(r[0] for r in results))
            state_bytes[f"EP {ep} (DP {ep})"] = results[0][1]
            peak_bytes[f"EP {ep} (DP {ep})"] = max(r[2] for r in results)
        for grouped in (True, False):
            times = run_local(_layer, 1, args, grouped, timeout=1800)[0]
            for part, seconds in times.items():
                layer.setdefault(f"{part} ({'grouped' if grouped else 'loop'})", []).append(seconds)

    tokens = args.micro_batch_size * args.seq_length
    step = _median_rows(steps)
    print(
        f"model: {args.num_layers} layers, hidden {args.hidden_size}, {args.num_experts} experts "
        f"of {args.expert_ffn}, top-{args.topk} (dense MLP {args.topk * args.expert_ffn}); "
        f"{tokens} tokens per rank and step; gloo, one thread per rank"
    )
    print(
        f"\n{'run':28s} {'s/step':>8s} {'tokens/s':>9s} {'state MB/rank':>14s} "
        f"{'peak MB/rank':>13s} {'vs dense':>9s}"
    )
    for name, seconds in step.items():
        print(
            f"{name:28s} {seconds:8.3f} {tokens / seconds:9.0f} "
            f"{state_bytes[name] / 1e6:14.1f} {peak_bytes[name] / 1e6:13.1f} "
            f"{seconds / step['dense']:8.2f}x"
        )
    scale = _median_rows(scaling)
    print(
        f"\n{'run':28s} {'s/step':>8s} {'efficiency':>10s} {'state MB/rank':>14s} "
        f"{'peak MB/rank':>13s}"
    )
    for ep in sizes:
        side, mine = scale[f"{ep} x EP 1 side by side"], scale[f"EP {ep} (DP {ep})"]
        print(f"{f'{ep} x EP 1 side by side':28s} {side:8.3f} {'(anchor)':>10s}")
        held = state_bytes[f"EP {ep} (DP {ep})"] / 1e6
        peak = peak_bytes[f"EP {ep} (DP {ep})"] / 1e6
        print(
            f"{f'EP {ep} (DP {ep})':28s} {mine:8.3f} {side / mine:10.1%} {held:14.1f} {peak:13.1f}"
        )
    parts = _median_rows(layer)
    print(f"\n{'MoE layer, fwd + bwd':28s} {'ms':>8s} {'share':>8s}")
    for kind in ("grouped", "loop"):
        whole = parts[f"layer ({kind})"]
        router, experts = parts[f"router ({kind})"], parts[f"experts ({kind})"]
        dispatch = max(0.0, whole - router - experts)
        for label, seconds in (
            (f"layer ({kind})", whole),
            ("  router", router),
            ("  experts", experts),
            ("  dispatch (the rest)", dispatch),
        ):
            print(f"{label:28s} {seconds * 1e3:8.2f} {seconds / whole:8.1%}")
    grouped, loop = parts["experts (grouped)"], parts["experts (loop)"]
    print(
        f"\nexperts: grouped GEMM {grouped * 1e3:.2f} ms, loop {loop * 1e3:.2f} ms, "
        f"loop / grouped {loop / grouped:.2f}x"
    )
    with open(args.json, "w") as f:
        json.dump(
            {
                "args": vars(args),
                "steps": steps,
                "state_bytes": state_bytes,
                "peak_bytes": peak_bytes,
                "scaling": scaling,
                "layer": layer,
            },
            f,
            indent=1,
        )
    return 0


if __name__ == "__main__":
    run(main)
