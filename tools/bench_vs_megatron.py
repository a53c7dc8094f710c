"""tripod against megatron-core: side by side on the same weights and batches (--layouts), or
tokens/s and peak memory of one training step on the same GPU (the default).

--layouts tp1 tp2-sp pp2-1f1b dp2-distopt ep2-moe (or all): both engines train the same
Llama-style model from the same initial weights on the same batches of an indexed dataset, on
gloo ranks (tools/side_by_side.py), and one table gives per layout the largest relative
difference of their losses, the median step time of each and the ratio, and the peak bytes of
live tensors per rank of each (engine/planning/live_memory.py) and the ratio. --tiny is the
suite's size; the default size takes over a second a step on a 2-core CPU.

Without --layouts:

The same GPT model (Megatron-LM's defaults: learned positions, LayerNorm, GeLU, biases, tied
embeddings; shapes from --model), the same micro-batch of random tokens, bf16 with fp32 main
weights and gradients, Adam, gradient clipping at 1.0, one GPU. megatron-core (0.16.1, its
local transformer implementation: get_gpt_layer_local_spec, no Transformer Engine, no apex)
runs the step as Megatron-LM's training loop does: Float16Module, its DistributedDataParallel
with fp32 gradient buffers, get_megatron_optimizer. tripod runs its real training step
(tools/bench_throughput.py's timing), fused kernels when they build. Every attempt is a fresh
process; the micro-batch is the largest of --micro-batch-sizes that fits megatron-core, and
tripod runs the same. Prints a
table (the ratio is tripod's tokens/s over megatron-core's) and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from engine.cli import run_main
from engine.config.arguments import ArgumentParser
from engine.errors import ConfigError
from engine.monitor.metrics import device_peak_tflops
from engine.planning.bench_setup import corpus_dataset
from engine.planning.bench_variants import MODELS, bench_variant

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as `python tools/bench_vs_megatron.py`: its sibling modules
    sys.path.insert(0, ROOT)


def megatron_step(args, micro_batch: int) -> dict:
    """Median step seconds of megatron-core on this process's GPU (module docstring)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        ffn_hidden_size=4 * args.hidden_size,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        init_method_std=0.02,
        gradient_accumulation_fusion=False,  # needs apex
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,  # needs Megatron-LM's own CUDA kernels
        attention_softmax_in_fp32=True,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=args.vocab_size,
        max_sequence_length=args.seq_length,
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
    ).cuda()
    model = Float16Module(config, model)
    ddp = DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-4,
            weight_decay=0.01,
            bf16=True,
            params_dtype=torch.bfloat16,
            clip_grad=1.0,
            use_distributed_optimizer=False,
        ),
        [ddp],
    )
    seq, device = args.seq_length, torch.device("cuda", 0)
    tokens = torch.randint(0, args.vocab_size, (micro_batch, seq + 1), device=device)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(micro_batch, -1)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device).triu(1)  # True: hidden
    times = []
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        loss = ddp(inputs, positions, mask, labels=labels)
        loss.float().mean().backward()
        ddp.finish_grad_sync()
        optimizer.step()
        torch.cuda.synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    dist.destroy_process_group()
    return {
        "step_s": statistics.median(times),
        "params": params,
        "mem_gb": torch.cuda.max_memory_allocated(device) / 1e9,
    }


def _megatron_worker(args) -> int:
    try:
        result = megatron_step(args, args.worker_micro_batch)
    except torch.cuda.OutOfMemoryError:
        result = "oom"
    except Exception as err:  # noqa: BLE001 - reported as the row's finding
        result = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"
    with open(args.worker_json, "w") as f:
        json.dump(result, f)
    return 0


def bench_megatron(args) -> dict:
    """megatron-core's row: the largest micro-batch that fits, each try a fresh process."""
    for micro_batch in args.micro_batch_sizes:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            command = [sys.executable, os.path.abspath(__file__), "--worker-micro-batch"]
            command += [str(micro_batch), "--worker-json", out.name]
            command += _shape_flags(args)
            try:
                done = subprocess.run(
                    command, cwd=ROOT, timeout=args.attempt_timeout, capture_output=True, text=True
                )
            except subprocess.TimeoutExpired:
                return {"error": f"timed out after {args.attempt_timeout:.0f}s"}
            try:
                with open(out.name) as f:
                    result = json.load(f)
            except (OSError, ValueError):
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
                return {"error": f"exit code {done.returncode}: {' '.join(tail)[:300]}"}
        if result == "oom":
            continue
        if isinstance(result, str):
            return {"error": result}
        tokens_per_s = micro_batch * args.seq_length / result["step_s"]
        return result | {"micro_batch": micro_batch, "tokens_per_s": tokens_per_s}
    return {"error": f"no micro-batch size in {args.micro_batch_sizes} fits in memory"}


def _shape_flags(args) -> list[str]:
    flags = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size)]
    flags += ["--num-attention-heads", str(args.num_attention_heads)]
    flags += ["--seq-length", str(args.seq_length), "--vocab-size", str(args.vocab_size)]
    return flags + ["--warmup", str(args.warmup), "--steps", str(args.steps)]


# side-by-side sizes: (layers, hidden, heads, query groups, ffn, seq, micro-batch, micro-batches)
SIDE_BY_SIDE = {"tiny": (2, 64, 4, 2, 128, 32, 2, 2), "default": (4, 512, 8, 4, 1408, 512, 2, 4)}


def side_by_side(args) -> int:
    from tools.side_by_side import CASES, Shape, dataset_batches, run_case

    names = list(CASES) if "all" in args.layouts else args.layouts
    needed = 3 if args.profile else 2  # the memory step, the profiled one, a timed one
    if args.steps < needed:
        profiled = ", the second is profiled" if args.profile else ""
        raise ConfigError(
            f"--steps {args.steps}: --layouts needs at least {needed} (the first step counts "
            f"memory{profiled}, the rest are timed)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        if args.data_path:
            prefix, vocab = args.data_path, args.data_vocab_size
        else:
            vocab = 2000 if args.tiny else 8000
            prefix, _ = corpus_dataset(os.path.join(tmp, "data"), vocab_size=vocab)
        layers, hidden, heads, groups, ffn, seq, mbs, m = SIDE_BY_SIDE[
            "tiny" if args.tiny else "default"
        ]
        shape = Shape(
            num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
            num_query_groups=groups, ffn_hidden_size=ffn, seq_length=seq, micro_batch_size=mbs,
            microbatches=m, padded_vocab_size=-(-vocab // 256) * 256, moe_ffn_hidden_size=ffn // 2,
            bf16=args.bf16,
        )  # fmt: skip
        rows = []
        for name in names:
            case = CASES[name]
            batches = dataset_batches(prefix, shape, case, args.steps)
            rows.append(run_case(case, shape, batches, os.path.join(tmp, "runs"), args.profile))
            print(f"  {name}: done", flush=True)
    print(
        f"tripod beside megatron-core 0.16.1 (local spec), {'bf16' if args.bf16 else 'fp32'}, "
        f"{args.steps} steps: {layers} "
        f"layers, hidden {hidden}, seq {seq}, {m} micro-batches of {mbs} per data-parallel rank"
    )
    print(
        "| layout | ranks | loss rel. diff | tripod s/step | megatron-core s/step | ratio "
        "| tripod peak MB/rank | megatron-core peak MB/rank | ratio |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ours, theirs = r["tripod"], r["megatron"]
        print(
            f"| {r['layout']} | {r['world']} | {r['loss_rel_error']:.1e} "
            f"| {ours['step_s']:.3f} | {theirs['step_s']:.3f} | {r['time_ratio']:.2f} "
            f"| {ours['peak_bytes'] / 2**20:.1f} | {theirs['peak_bytes'] / 2**20:.1f} "
            f"| {r['memory_ratio']:.2f} |"
        )
    if args.profile:
        for r in rows:
            for engine in ("tripod", "megatron"):
                print(f"\n{r['layout']}, {engine}: self CPU ms of the costliest operations")
                for name, ms, calls in r[engine]["profile"]:
                    print(f"  {ms:9.1f}  {calls:6d}  {name}")
    by_name = {r["layout"]: r for r in rows}
    spread = None
    if "tp1" in by_name and "tp2-sp" in by_name:  # the same batches (DP 1), another order
        pairs = zip(
            by_name["tp1"]["megatron"]["losses"],
            by_name["tp2-sp"]["megatron"]["losses"],
            strict=True,
        )
        spread = max(abs(a - b) / abs(b) for a, b in pairs)
        print(
            f"megatron-core against itself, TP1 beside TP2 with SP (the same batches, another "
            f"reduction order): largest loss rel. diff {spread:.1e}"
        )
    with open(args.json, "w") as f:
        report = {"shape": dataclasses.asdict(shape), "rows": rows, "megatron_spread": spread}
        json.dump(report, f, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    from tools.side_by_side import CASES

    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--layouts",
        nargs="+",
        choices=[*CASES, "all"],
        help="side by side on gloo ranks, these layouts",
    )
    parser.add_argument("--tiny", action="store_true", help="--layouts at the suite's size")
    parser.add_argument(
        "--bf16", action="store_true", help="--layouts in bf16 (fp32 main weights and gradients)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="--layouts: profile the second step of each engine (torch.profiler, CPU) and print "
        "its costliest operations; that step is not timed",
    )
    parser.add_argument("--data-path", help="--layouts: an indexed dataset's prefix")
    parser.add_argument(
        "--data-vocab-size", type=int, default=2000, help="the --data-path tokenizer's vocabulary"
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="1.3b")
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--hidden-size", type=int)
    parser.add_argument("--num-attention-heads", type=int)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[16, 12, 8, 4, 2, 1])
    parser.add_argument("--tripod-variant", default="fused", choices=["fused", "torch"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--attempt-timeout", type=float, default=900)
    parser.add_argument("--json", default="bench_vs_megatron.json")
    parser.add_argument("--worker-micro-batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker-json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.layouts:
        return side_by_side(args)
    layers, hidden, heads = MODELS[args.model]
    args.num_layers = args.num_layers or layers
    args.hidden_size = args.hidden_size or hidden
    args.num_attention_heads = args.num_attention_heads or heads
    if args.worker_micro_batch:
        return _megatron_worker(args)
    if not torch.cuda.is_available():
        print("bench_vs_megatron: needs a CUDA GPU (megatron-core's model runs on CUDA only)")
        return 2
    name = torch.cuda.get_device_name()
    peak, _ = device_peak_tflops(torch.device("cuda"), "bf16")
    megatron = bench_megatron(args)
    if "micro_batch" in megatron:  # the same micro-batch for both
        args.micro_batch_sizes = [megatron["micro_batch"]]
    with tempfile.TemporaryDirectory() as tmp:
        prefix, tokenizer = corpus_dataset(tmp)
        tripod = bench_variant(args, prefix, tokenizer, args.tripod_variant, "cuda")
    for row in (tripod, megatron):  # model FLOPs as the engine counts them, for both
        if "tokens_per_s" in row and "flops_per_token" in tripod:
            row["tflops"] = row["tokens_per_s"] * tripod["flops_per_token"] / 1e12
    rows = {f"tripod ({args.tripod_variant})": tripod, "megatron-core 0.16.1 local": megatron}
    print(
        f"device: {name}; torch {torch.__version__}; {args.num_layers} layers, hidden "
        f"{args.hidden_size}, seq {args.seq_length}, vocabulary {args.vocab_size}, bf16"
    )
    print(f"{'engine':28s} {'mbs':>4s} {'tokens/s':>10s} {'MFU':>6s} {'mem GB':>7s}")
    for label, r in rows.items():
        if "error" in r:
            print(f"{label:28s} failed: {r['error']}")
            continue
        mfu = f"{r['tflops'] / peak:6.1%}" if peak and r.get("tflops") else "   n/a"
        print(
            f"{label:28s} {r['micro_batch']:4d} {r['tokens_per_s']:10,.0f} {mfu} {r['mem_gb']:7.1f}"
        )
    if "error" not in tripod and "error" not in megatron:
        ratio = tripod["tokens_per_s"] / megatron["tokens_per_s"]
        print(f"tripod / megatron-core tokens/s: {ratio:.2f}x")
    with open(args.json, "w") as f:
        json.dump(
            {"device": name, "torch": torch.__version__, "runs": rows, "config": vars(args)},
            f,
            indent=1,
        )
    return 0


if __name__ == "__main__":
    run_main(main)
