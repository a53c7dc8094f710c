"""22 Megatron-LM training commands, moved over as a Megatron-LM user would move them.

Each is a command of the kind Megatron-LM's documentation and examples/ give (dense GPT and
Llama; tensor, sequence, pipeline with and without virtual stages, context and data
parallelism; the distributed optimizer and Megatron FSDP; fp16 and bf16; logging;
checkpointing, resuming and fine-tuning; schedules by samples; Megatron-LM's newest flags),
shrunk to a laptop: a model of a few layers, the built-in corpus, a few iterations, at most 4
processes. Each runs first through the migration report (`python -m engine.pretrain
--check-megatron-args`), then, where that says it would train, through
examples/pretrain_gpt.sh (torchrun, gloo on the CPU). A command stops either way with what
happened: trained (its last iteration and loss) or refused (the one line naming what is
missing). Commands that resume read the checkpoint an earlier one saved.

    python tools/megatron_commands.py [--data data/quickstart] [--only NAME ...] [--json F]

`make quickstart` (or tools/prepare_data.py) makes the corpus folder first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from engine.config.arguments import ArgumentParser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A GPT-3-style shape and schedule (examples/gpt3/train_gpt3_175b_distributed.sh's flags,
# shrunk), and the Llama-3 family's (examples/llama/train_llama3_8b_h100_fp8.sh's, shrunk).
GPT = [
    *("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"),
    *("--seq-length", "64", "--max-position-embeddings", "64"),
    *("--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "6"),
    *("--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95"),
    *("--init-method-std", "0.006", "--clip-grad", "1.0", "--lr", "6.0e-4"),
    *("--lr-decay-style", "cosine", "--min-lr", "6.0e-5", "--lr-warmup-fraction", ".001"),
    *("--lr-decay-iters", "430000", "--log-interval", "1", "--eval-interval", "3"),
    *("--eval-iters", "1"),
]
LLAMA = [
    *("--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "176"),
    *("--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2"),
    *("--kv-channels", "16", "--seq-length", "64", "--max-position-embeddings", "64"),
    *("--position-embedding-type", "rope", "--rotary-base", "500000"),
    *("--rotary-percent", "1.0", "--swiglu", "--normalization", "RMSNorm", "--norm-epsilon"),
    *("1e-05", "--untie-embeddings-and-output-weights", "--disable-bias-linear"),
    *("--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--init-method-std", "0.0134"),
    *("--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "6"),
    *("--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine"),
    *("--lr-warmup-iters", "2", "--weight-decay", "0.1", "--adam-beta1", "0.9"),
    *("--adam-beta2", "0.95", "--clip-grad", "1.0", "--log-interval", "1"),
    *("--eval-interval", "3", "--eval-iters", "1", "--use-mcore-models"),
]


@dataclass(frozen=True)
class Command:
    name: str
    what: str
    world: int  # processes (NPROC_PER_NODE)
    flags: tuple[str, ...]  # with placeholders (`_fill`)
    expect: str  # "train", or the words the refusal names


COMMANDS = (
    Command("gpt3-dp4", "GPT-3's flags on 4 data-parallel ranks", 4, (*GPT,), "train"),
    Command(
        "gpt3-tp2-sp",
        "tensor parallelism with sequence parallelism",
        2,
        (*GPT, "--tensor-model-parallel-size", "2", "--sequence-parallel"),
        "train",
    ),
    Command(
        "gpt3-pp2",
        "pipeline parallelism (1F1B)",
        2,
        (*GPT, "--pipeline-model-parallel-size", "2"),
        "train",
    ),
    Command(
        "gpt3-pp2-virtual",
        "interleaved pipeline with overlapped transfers",
        2,
        (
            *GPT,
            *("--pipeline-model-parallel-size", "2"),
            *("--num-layers-per-virtual-pipeline-stage", "1", "--overlap-p2p-communication"),
        ),
        "train",
    ),
    Command(
        "gpt3-tp2-pp2",
        "tensor and pipeline parallelism with the distributed optimizer",
        4,
        (
            *GPT,
            *("--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"),
            "--use-distributed-optimizer",
        ),
        "train",
    ),
    Command(
        "llama-cp2",
        "context parallelism over a ring (Llama shape)",
        2,
        (*LLAMA, "--context-parallel-size", "2", "--cp-comm-type", "p2p"),
        "train",
    ),
    Command(
        "gpt3-distopt-overlap",
        "distributed optimizer (2 instances) with overlapped reduce and gather",
        4,
        (
            *GPT,
            *("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"),
            *("--ddp-average-in-collective", "--ddp-bucket-size", "200000"),
            *("--num-distributed-optimizer-instances", "2"),
        ),
        "train",
    ),
    Command(
        "llama-megatron-fsdp",
        "Megatron FSDP sharding parameters, gradients and optimizer",
        2,
        (
            *LLAMA,
            *("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"),
        ),
        "train",
    ),
    Command(
        "llama-bf16",
        "Llama in bf16 with the distributed optimizer",
        2,
        (*LLAMA, "--bf16", "--use-distributed-optimizer", "--attention-softmax-in-fp32"),
        "train",
    ),
    Command(
        "gpt3-fp16",
        "fp16 with a dynamic loss scale",
        2,
        (
            *GPT,
            *("--fp16", "--initial-loss-scale", "65536", "--min-loss-scale", "1"),
            *("--loss-scale-window", "1000", "--hysteresis", "2"),
            "--apply-query-key-layer-scaling",
        ),
        "train",
    ),
    Command(
        "gpt3-logging",
        "Megatron-LM's logging flags to TensorBoard",
        2,
        (
            *GPT,
            *("--log-params-norm", "--log-num-zeros-in-grad", "--log-throughput"),
            *("--log-timers-to-tensorboard", "--log-validation-ppl-to-tensorboard"),
            *("--log-memory-to-tensorboard", "--timing-log-level", "2"),
            *("--tensorboard-dir", "{tb}", "--tensorboard-log-interval", "2"),
            *("--tensorboard-queue-size", "5", "--logging-level", "20"),
        ),
        "train",
    ),
    Command(
        "llama-save",
        "torch_dist checkpoints, saved asynchronously",
        2,
        (
            *LLAMA,
            *("--save", "{ckpt}", "--save-interval", "3", "--ckpt-format", "torch_dist"),
            *("--async-save", "--use-persistent-ckpt-worker", "--ckpt-fully-parallel-save"),
            *("--ckpt-fully-parallel-load", "--dist-ckpt-strictness", "log_all"),
        ),
        "train",
    ),
    Command(
        "llama-resume-longer",
        "resume the checkpoint and train longer on the checkpoint's schedule",
        2,
        (
            *LLAMA,
            *("--train-iters", "9", "--load", "{ckpt}", "--save", "{ckpt}"),
            *("--save-interval", "3", "--use-checkpoint-opt_param-scheduler"),
            "--exit-on-missing-checkpoint",
        ),
        "train",
    ),
    Command(
        "llama-resume-new-schedule",
        "resume under another layout with the command line's schedule",
        2,
        (
            *LLAMA,
            *("--train-iters", "12", "--load", "{ckpt}", "--override-opt_param-scheduler"),
            *("--tensor-model-parallel-size", "2", "--no-load-rng"),
        ),
        "train",
    ),
    Command(
        "llama-finetune",
        "fine-tune from the checkpoint's weights",
        2,
        (*LLAMA, "--load", "{ckpt}", "--finetune", "--no-load-optim", "--lr", "1e-4"),
        "train",
    ),
    Command(
        "gpt3-samples-rampup",
        "a run counted in samples with a batch-size ramp-up",
        2,
        (
            *[f for f in GPT if f not in ("--train-iters", "6", "--lr-decay-iters", "430000")],
            *("--train-samples", "96", "--lr-decay-samples", "96"),
            *("--rampup-batch-size", "8", "8", "32"),
        ),
        "train",
    ),
    Command(
        "gpt3-checks",
        "deterministic mode, gloo, weight-hash checks, Megatron-LM's rerun mode off",
        2,
        (
            *GPT,
            *("--deterministic-mode", "--distributed-backend", "gloo", "--seed", "1234"),
            *("--check-weight-hash-across-dp-replicas-interval", "2", "--rerun-mode"),
            *("disabled", "--exit-signal-handler", "--no-rope-fusion"),
        ),
        "train",
    ),
    Command(
        "gpt3-pp2-mapping-groups",
        "the tp-pp-dp rank order, micro-batch groups, and separate evaluation batches "
        "(core_v0.19.0's flags)",
        4,
        (
            *GPT,
            *("--pipeline-model-parallel-size", "2", "--use-tp-pp-dp-mapping"),
            *("--num-layers-per-virtual-pipeline-stage", "1"),
            *("--microbatch-group-size-per-virtual-pipeline-stage", "4"),
            *("--eval-global-batch-size", "8", "--eval-micro-batch-size", "1"),
        ),
        "train",
    ),
    Command(
        "gpt3-blend",
        "a weighted blend of two datasets with a data cache and loader workers",
        2,
        (
            *GPT,
            *("--data-path", "0.7", "{prefix}", "0.3", "{prefix}", "--split", "98,2,0"),
            *("--data-cache-path", "{cache}", "--num-workers", "2"),
        ),
        "train",
    ),
    Command(
        "mixtral-moe",
        "a Mixtral-style mixture of experts (examples/mixtral) on 2 expert-parallel ranks",
        4,
        (
            *LLAMA,
            *("--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type"),
            *("aux_loss", "--moe-aux-loss-coeff", "1e-2", "--expert-model-parallel-size", "2"),
        ),
        "train",
    ),
    Command(
        "mixtral-moe-ep1",
        "the same mixture of experts, grouped GEMM, without expert parallelism",
        2,
        (
            *LLAMA,
            *("--num-experts", "4", "--moe-router-topk", "2", "--moe-router-load-balancing-type"),
            *("aux_loss", "--moe-aux-loss-coeff", "1e-2", "--moe-grouped-gemm"),
            *("--moe-token-dispatcher-type", "alltoall", "--use-distributed-optimizer"),
        ),
        "train",
    ),
    Command(
        "llama-fp8",
        "FP8 training (examples/llama's fp8 branch)",
        2,
        (*LLAMA, "--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024"),
        "train",
    ),
)


def _fill(flags, folders: dict[str, str]) -> list[str]:
    """The flags with {ckpt}, {tb}, {cache} (this run's folders) and {prefix} (the corpus's
    dataset) filled in."""
    out = []
    for flag in flags:
        for key, value in folders.items():
            flag = flag.replace("{" + key + "}", value)
        out.append(flag)
    return out


def check(command: Command, folders: dict[str, str]) -> tuple[int, str]:
    """The migration report of the command: (exit code, its refusal lines or '')."""
    done = subprocess.run(
        [sys.executable, "-m", "engine.pretrain", "--check-megatron-args"]
        + _fill(command.flags, folders),
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    lines = [
        line
        for line in done.stdout.splitlines()
        if ": refused" in line or line.startswith("values:")
    ]
    return done.returncode, "; ".join(lines)


def train(command: Command, data: str, folders: dict[str, str], timeout: int) -> tuple[int, str]:
    """Run it through examples/pretrain_gpt.sh: (exit code, the last iteration's line or the
    last line of the error)."""
    env = dict(
        os.environ,
        NPROC_PER_NODE=str(command.world),
        DATA=data,
        PYTHON=sys.executable,
        CUDA_VISIBLE_DEVICES="",
    )
    env.pop("MASTER_PORT", None)  # one machine: torchrun's --standalone picks a free port
    done = subprocess.run(
        ["bash", os.path.join(ROOT, "examples", "pretrain_gpt.sh"), *_fill(command.flags, folders)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
    )
    lines = (done.stdout + done.stderr).splitlines()
    iterations = [line for line in lines if line.startswith("iteration ")]
    if done.returncode == 0 and iterations:
        return 0, iterations[-1]
    return done.returncode or 1, lines[-1] if lines else "no output"


def run(commands, data: str, work: str, timeout: int = 600) -> list[dict]:
    """Each command's report and, where it would train, its run; rows in order."""
    folders = {name: os.path.join(work, name) for name in ("ckpt", "tb", "cache")}
    folders["prefix"] = os.path.join(data, "stdlib_text_document")
    rows = []
    for command in commands:
        start = time.monotonic()
        code, refused = check(command, folders)
        if code:
            row = {"outcome": "refused", "detail": refused}
        else:
            code, detail = train(command, data, folders, timeout)
            row = {"outcome": "trained" if code == 0 else f"failed ({code})", "detail": detail}
        row |= {"name": command.name, "what": command.what, "world": command.world}
        row["seconds"] = round(time.monotonic() - start, 1)
        expected = command.expect == "train"
        row["as_expected"] = (
            row["outcome"] == "trained" if expected else command.expect in row["detail"]
        )
        rows.append(row)
        print(f"{command.name:28s} {row['outcome']:9s} {row['seconds']:6.1f}s  {row['detail']}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=os.path.join(ROOT, "data", "quickstart"))
    parser.add_argument("--only", nargs="+", help="run only these commands (names)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    chosen = [c for c in COMMANDS if not args.only or c.name in args.only]
    with tempfile.TemporaryDirectory() as work:
        rows = run(chosen, os.path.abspath(args.data), work)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    unexpected = [r["name"] for r in rows if not r["as_expected"]]
    print(
        f"{len(rows) - len(unexpected)} of {len(rows)} as expected"
        + (f"; not: {', '.join(unexpected)}" if unexpected else "")
    )
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
