"""Each parallel layout on two GPUs over NCCL against the same run on two CPU processes over
gloo: the training losses must agree.

Layouts: TP2 (with sequence parallelism), PP2 with every schedule (gpipe, 1f1b, zb-h1;
interleaved, zb-v and dualpipe-v each with and without --overlap-p2p-communication), DP2 with
each sharding strategy, CP2, and a mixture of experts under DP2 x EP2 (the experts' all-to-all).
Each runs a small GPT (fp32, TF32 off, no dropout) on mock data for a few iterations through
engine.launch, once with `--device cuda` (NCCL) and once with `--device cpu` (gloo); a layout
passes when every logged loss agrees within --rtol. Prints a table; exits 1 if a run fails or a
loss differs. `make gpu-check` runs it on machines with two or more GPUs (tools/gpu_check.py).
`--cpu-only` runs both sides on CPU (a self-check of the tool: the losses must then be equal).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

from gpu_train_check import log_tail, train_losses  # tools/, this script's folder

from engine.config.arguments import ArgumentParser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = [
    *("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"),
    *("--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2"),
    *("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512"),
    *("--lr", "1e-3", "--lr-warmup-iters", "1", "--hidden-dropout", "0"),
    *("--attention-dropout", "0", "--no-tf32", "--log-interval", "1", "--eval-iters", "0"),
    *("--num-workers", "0", "--no-use-fused-kernels"),
]
PP2 = ["--pipeline-model-parallel-size", "2"]
VIRTUAL = ["--num-layers-per-virtual-pipeline-stage", "1"]  # 4 layers / (2 x 2): 2 chunks
OVERLAP = "--overlap-p2p-communication"
LAYOUTS: dict[str, list[str]] = {
    "tp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2-gpipe": [*PP2, "--pipeline-schedule", "gpipe"],
    "pp2-1f1b": [*PP2, "--pipeline-schedule", "1f1b"],
    "pp2-interleaved": [*PP2, *VIRTUAL],
    "pp2-interleaved-overlap": [*PP2, *VIRTUAL, OVERLAP],
    "pp2-zb-h1": [*PP2, "--pipeline-schedule", "zb-h1"],
    "pp2-zb-v": [*PP2, *VIRTUAL, "--pipeline-schedule", "zb-v"],
    "pp2-zb-v-overlap": [*PP2, *VIRTUAL, "--pipeline-schedule", "zb-v", OVERLAP],
    "pp2-dualpipe-v": [*PP2, *VIRTUAL, "--pipeline-schedule", "dualpipe-v"],
    "pp2-dualpipe-v-overlap": [*PP2, *VIRTUAL, "--pipeline-schedule", "dualpipe-v", OVERLAP],
    "dp2-no_shard": [],
    "dp2-optim": ["--use-distributed-optimizer"],
    "dp2-optim_grads": ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"],
    "dp2-optim_grads_params": ["--use-megatron-fsdp"],
    "cp2": ["--context-parallel-size", "2"],
    # a mixture of experts, its 4 experts over 2 expert-parallel ranks: the all-to-all
    "dp2-ep2-moe": [
        "--num-experts",
        "4",
        "--moe-router-topk",
        "2",
        "--expert-model-parallel-size",
        "2",
    ],
}


def _run(layout: str, device: str, folder: str, iters: int) -> tuple[int, dict, str]:
    metrics = os.path.join(folder, f"{layout}-{device}.jsonl")
    log = metrics[: -len(".jsonl")] + ".log"
    micro_batches = 8 if layout.startswith("pp2") else 2  # dualpipe-v needs 2p = 4 or more
    flags = [*MODEL, *LAYOUTS[layout], "--global-batch-size", str(2 * micro_batches)]
    flags += ["--train-iters", str(iters), "--device", device, "--log-jsonl", metrics]
    command = [sys.executable, "-m", "engine.launch", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "engine.pretrain", *flags]
    env = dict(os.environ, PYTHONPATH=ROOT)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    with open(log, "w") as f:
        code = subprocess.run(command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    return code.returncode, train_losses(metrics), log_tail(log, 6)


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--rtol", type=float, default=1e-4)
    parser.add_argument("--cpu-only", action="store_true", help="both sides on CPU (self-check)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    import torch

    if not args.cpu_only and torch.cuda.device_count() < 2:
        print(f"nccl_parity: needs 2 CUDA GPUs, this machine has {torch.cuda.device_count()}")
        return 0
    device = "cpu" if args.cpu_only else "cuda"
    folder = tempfile.mkdtemp(prefix="nccl-parity-")
    rows, ok = [], True
    try:
        print(f"{'layout':26s} {'exit':>9s} {'iters':>5s} {'max rel diff':>12s}  result")
        for layout in args.layouts:
            code, losses, tail = _run(layout, device, folder, args.iters)
            ref_code, ref, ref_tail = _run(layout, "cpu", folder, args.iters)
            shared = sorted(set(losses) & set(ref))
            diff = max((abs(losses[i] - ref[i]) / abs(ref[i]) for i in shared), default=None)
            passed = (
                code == ref_code == 0
                and len(shared) == args.iters
                and diff is not None
                and diff <= (0.0 if args.cpu_only else args.rtol)
            )
            ok = ok and passed
            shown = "-" if diff is None else f"{diff:.2e}"
            print(f"{layout:26s} {code:4d}/{ref_code:<4d} {len(shared):5d} {shown:>12s}  "
                  f"{'ok' if passed else 'FAILED'}")  # fmt: skip
            if code or ref_code:
                print(tail if code else ref_tail)
            row = {"layout": layout, "exit": code, "gloo_exit": ref_code}
            rows.append(row | {"iterations": len(shared), "max_rel_diff": diff, "ok": passed})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "rtol": args.rtol, "rows": rows}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
