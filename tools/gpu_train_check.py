"""The user's path on this machine's GPUs: the example scripts through engine.launch (torchrun),
NCCL, bf16, checkpoints with --async-save, and resuming.

On the quickstart's data (built-in corpus, prepared in a temporary folder): a GPT run of 40
iterations that saves every 20 with --async-save; the same run resumed from its iteration-20
checkpoint to 40 (--load); a Llama-style run (examples/pretrain_llama.sh), a Mixtral-style
one (experts by the grouped GEMM), the DeepSeek-V3 proxy on one stage (MLA, sigmoid-routed
experts, MTP) and a Llama-style one with gpt-oss's attention (learned sinks, windows on every
other layer). The resumed run's losses must equal the uninterrupted run's after iteration 20
(bit-exact resume), and every run's loss must fall. Prints a table and exits 1 if a run
fails, a loss does not fall or the resumed losses differ. `make gpu-check` runs it
(tools/gpu_check.py); it needs a GPU (without one the scripts run CPU ranks, which is not what
it checks).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

from engine.config.arguments import ArgumentParser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = ["--log-interval", "10", "--eval-interval", "20", "--eval-iters", "2"]


def _run(command: list[str], env: dict, log: str) -> int:
    with open(log, "w") as f:
        return subprocess.run(
            command, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT
        ).returncode


def train_losses(path: str) -> dict[int, float]:
    """Training losses by iteration from a --log-jsonl file (empty if the run wrote none)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return {r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r and "lr" in r}


def learned(losses: dict[int, float]) -> bool:
    """Whether a run's losses are finite and its last is below its first."""
    values = [losses[i] for i in sorted(losses)]
    return len(values) >= 2 and all(math.isfinite(v) for v in values) and values[-1] < values[0]


def log_tail(path: str, lines: int = 8) -> str:
    """The last lines of a run's log."""
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--keep", help="keep the runs in this folder")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_train_check: no CUDA GPU here; nothing to check")
        return 0
    folder = args.keep or tempfile.mkdtemp(prefix="gpu-train-")
    os.makedirs(folder, exist_ok=True)
    bin_dir = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    env |= {"DATA": os.path.join(folder, "data"), "PYTHON": sys.executable}
    rows, ok = [], True
    try:
        prepare = _run(["bash", "examples/prepare_data.sh"], env, os.path.join(folder, "data.log"))
        if prepare != 0:
            print("prepare_data.sh failed:\n" + log_tail(os.path.join(folder, "data.log")))
            return 1
        ckpt, at_20 = os.path.join(folder, "ckpt"), os.path.join(folder, "ckpt_at_20")
        save = ["--save", ckpt, "--save-interval", "20", "--async-save"]
        forty = ["--train-iters", "40"]
        sinks = ["--softmax-type", "learnable", "--window-size", "(64, 0)"]
        runs = [
            ("gpt 40 iters, async save", "pretrain_gpt.sh", [*forty, *save], {}),
            ("gpt resumed at 20", "pretrain_gpt.sh", [*forty, "--load", at_20], {}),
            ("llama 40 iters", "pretrain_llama.sh", forty, {}),
            ("mixtral 40 iters", "pretrain_mixtral.sh", forty, {}),
            ("deepseek-v3 40 iters", "pretrain_deepseek_v3.sh", forty, {"PP": "1"}),
            ("gpt-oss attention 40 iters", "pretrain_llama.sh",
             [*forty, *sinks, "--window-attn-skip-freq", "2", "--attention-dropout", "0"], {}),
        ]  # fmt: skip
        losses = {}
        for name, script, flags, extra_env in runs:
            if "--load" in flags:  # the first run's checkpoints, as if it had stopped at 20
                shutil.copytree(ckpt, at_20)
                shutil.rmtree(os.path.join(at_20, "iter_0000040"), ignore_errors=True)
                with open(os.path.join(at_20, "latest_checkpointed_iteration.txt"), "w") as f:
                    f.write("20")
            metrics = os.path.join(folder, name.replace(" ", "_").replace(",", "") + ".jsonl")
            log = metrics[: -len(".jsonl")] + ".log"
            command = ["bash", f"examples/{script}", *flags, *SHORT, "--log-jsonl", metrics]
            code = _run(command, env | extra_env, log)
            losses[name] = train_losses(metrics)
            last = max(losses[name]) if losses[name] else None
            rows.append((name, code, last, losses[name].get(last) if last else None))
            if code != 0:
                ok = False
                print(f"{name}: exit code {code}\n{log_tail(log)}")
            elif not learned(losses[name]):
                ok = False
                print(f"{name}: the loss did not fall: {losses[name]}")
        first, resumed = losses["gpt 40 iters, async save"], losses["gpt resumed at 20"]
        same = [i for i in resumed if i > 20 and first.get(i) == resumed[i]]
        differ = [i for i in resumed if i > 20 and first.get(i) != resumed[i]]
        print(f"device: {torch.cuda.get_device_name()} x{torch.cuda.device_count()}")
        print(f"{'run':28s} {'exit':>4s} {'last iter':>9s} {'lm loss':>10s}")
        for name, code, last, loss in rows:
            print(f"{name:28s} {code:4d} {last or '-':>9} {loss if loss is not None else '-':>10}")
        print(f"resume: iterations {same} equal, {differ} differ")
        ok = ok and bool(same) and not differ
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
