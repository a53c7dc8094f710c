"""A benchmark model's training step timed in fresh processes, one per attempt: the shapes
(GPT-3's 125M, 350M and 1.3B) and op variants tools/bench_throughput.py and
tools/bench_vs_megatron.py share. `args` carries the shape (num_layers, hidden_size,
num_attention_heads, seq_length, vocab_size), warmup, steps, micro_batch_sizes and
attempt_timeout."""

from __future__ import annotations

import torch

from engine.planning.bench_setup import engine_flags, time_train_steps
from parallel.local_ranks import run_local

MODELS = {  # name: (layers, hidden, heads): GPT-2 / GPT-3 paper shapes
    "125m": (12, 768, 12),
    "350m": (24, 1024, 16),
    "1.3b": (24, 2048, 16),
}
VARIANTS = {  # name: engine flags
    "fused": ["--use-fused-kernels"],
    "torch": ["--no-use-fused-kernels"],
    "fused+compile": ["--use-fused-kernels", "--torch-compile"],
    "torch+compile": ["--no-use-fused-kernels", "--torch-compile"],
    # FP8 (docs/fp8.md): the recipes on the engine's GEMMs, and tensorwise on torchao's
    "fused+fp8": ["--use-fused-kernels", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "fused+fp8-delayed": ["--use-fused-kernels", "--fp8-format", "hybrid"],
    "fused+fp8-blockwise": [
        "--use-fused-kernels",
        "--fp8-format",
        "hybrid",
        "--fp8-recipe",
        "blockwise",
    ],
    "fused+fp8-torchao": [
        "--use-fused-kernels",
        "--fp8-format",
        "hybrid",
        "--fp8-recipe",
        "tensorwise",
        "--fp8-backend",
        "torchao",
    ],
}


def _attempt(rank, world, args, prefix, tokenizer, variant: str, micro_batch: int, device: str):
    """One timed run in a process of its own: the result, "oom", or the error in one line."""
    flags = engine_flags(
        prefix,
        tokenizer,
        args.num_layers,
        args.hidden_size,
        args.seq_length,
        micro_batch,
        num_attention_heads=str(args.num_attention_heads),
        vocab_size=str(args.vocab_size),
        train_iters="1000",
        lr="1e-4",
        lr_decay_style="constant",
        hidden_dropout="0.0",
        attention_dropout="0.0",
        device=device,
        make_vocab_size_divisible_by="128",
    )
    flags += (["--bf16"] if device == "cuda" else []) + VARIANTS[variant]
    try:
        r = time_train_steps(flags, args.warmup, args.steps, device)
    except torch.cuda.OutOfMemoryError:
        return "oom"
    except Exception as err:  # noqa: BLE001 - a failed variant is a row of the table
        return f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"
    tokens_per_s = micro_batch * args.seq_length / r["step_s"]
    return {
        "micro_batch": micro_batch,
        "step_s": r["step_s"],
        "tokens_per_s": tokens_per_s,
        "tflops": tokens_per_s * r["flops_per_token"] / 1e12,
        "params": r["params"],
        "mem_gb": r["mem_gb"],
        "flops_per_token": r["flops_per_token"],
    }


def bench_variant(args, prefix, tokenizer, variant: str, device: str) -> dict:
    """The largest of --micro-batch-sizes that fits, each tried in a fresh process (a failed
    attempt's memory goes with its process)."""
    for micro_batch in args.micro_batch_sizes:
        try:
            result = run_local(
                _attempt,
                1,
                args,
                prefix,
                tokenizer,
                variant,
                micro_batch,
                device,
                timeout=args.attempt_timeout,
                threads=2,
                cpu_only=device == "cpu",
            )[0]
        except AssertionError as err:  # the process died or ran out of time
            return {"error": str(err).strip().splitlines()[0][:300]}
        if result != "oom":
            return result if isinstance(result, dict) else {"error": result}
    return {"error": f"no micro-batch size in {args.micro_batch_sizes} fits in memory"}
