"""Benchmark preprocess_data.py against its anchors, side by side in one run, for a SentencePiece
and a Hugging Face byte-level BPE tokenizer.

Input: the built-in corpus, scaled to --target-mb of JSONL. Copy 0 is the corpus itself; copy r
shifts every ASCII letter by r places, so that no copy repeats another's words (gigatoken and
`tokenizers` cache the pieces they have encoded, and plain repeats would flatter them).

Rows, each a whole process on the same file (wall seconds; the rate leaves out the tool's own
start-up, measured on a one-document input, so it is the steady rate):
  - ours: preprocess_data.py --workers 1 and 2 (the default: the tokenizer's own library), and
    --tokenize-with auto (opt-in: gigatoken underneath where it passes the probes);
  - Megatron-LM's tools/preprocess_data.py --workers 2 and tools/preprocess_data_fast.py
    (gigatoken; Hugging Face tokenizers only), when --megatron-python and --megatron-root
    name a Python that runs them (see docs/benchmarks.md);
  - the ceilings, in a fresh process with the texts already in memory: the tokenizer library's
    own batch encode and gigatoken's, on all cores.
Peak memory is the proportional set size (PSS) summed over the whole process tree (main and
workers), sampled every 20 ms: pages that forked workers share with the main process count once,
where a sum of resident sizes would count them once per process. Ours at 2 workers (and
Megatron-LM's gigatoken tool) run again at --large-mb: peak memory must not grow with the input,
and the longer run gives a steadier rate.
Prints a table and writes JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from functools import partial

from engine.cli import run_main as run
from engine.config.arguments import ArgumentParser
from engine.planning.bench_setup import bench_tokenizers, shifted_documents

TOOL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "preprocess_data.py")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}


def write_corpus(path: str, target_bytes: int) -> int:
    """JSONL of about target_bytes of text; returns the text bytes written."""
    size = 0
    with open(path, "w", encoding="utf-8") as f:
        for text in shifted_documents(target_bytes):
            f.write(json.dumps({"text": text}) + "\n")
            size += len(text.encode("utf-8"))
    return size


def _tree_pss(pid: int) -> int:
    """Proportional set size in bytes of a process and all its descendants (Linux /proc)."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


def measure(cmd: list[str], env: dict | None = None) -> tuple[float, int]:
    """(wall seconds, peak PSS bytes of the process tree) of a command that must succeed."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, **OFFLINE, **(env or {})},
    )
    peak = [0]

    def sample():
        while proc.poll() is None:
            peak[0] = max(peak[0], _tree_pss(proc.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, err = proc.communicate()
    seconds = time.perf_counter() - start
    sampler.join()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed:\n{err.decode()[-2000:]}")
    return seconds, peak[0]


def _ours(inputs, prefix, tokenizer_flags, workers, tokenize_with="tokenizer") -> list[str]:
    return [
        sys.executable,
        TOOL,
        *("--input", inputs, "--output-prefix", prefix, *tokenizer_flags),
        *("--append-eod", "--workers", str(workers), "--no-progress"),
        *("--tokenize-with", tokenize_with),
    ]


def _megatron(args, fast: bool, inputs, prefix, tokenizer_flags) -> list[str]:
    script = "preprocess_data_fast.py" if fast else "preprocess_data.py"
    cmd = [
        args.megatron_python,
        os.path.join(args.megatron_root, "tools", script),
        *("--input", inputs, "--output-prefix", prefix, "--json-keys", "text"),
        *tokenizer_flags,
        "--append-eod",
    ]
    return cmd + (
        ["--use-gigatoken"] if fast else ["--workers", "2", "--log-interval", "1000000000"]
    )


CEILING = r"""
import json, sys, time
texts = [json.loads(line)["text"] for line in open(sys.argv[1], encoding="utf-8")]
kind, model = sys.argv[2], sys.argv[3]
out = {}
if kind == "sentencepiece":
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=model)
    start = time.perf_counter(); ids = sp.Encode(texts, num_threads=%(threads)d)
    out["library"] = time.perf_counter() - start
else:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(model + "/tokenizer.json")
    start = time.perf_counter(); ids = [e.ids for e in tok.encode_batch_fast(texts)]
    out["library"] = time.perf_counter() - start
out["tokens"] = sum(len(i) for i in ids) + len(texts)
try:
    import gigatoken
except ImportError:
    gigatoken = None
if gigatoken is not None:
    g = (gigatoken.Tokenizer.from_sentencepiece(model) if kind == "sentencepiece"
         else gigatoken.Tokenizer(model))
    start = time.perf_counter(); g.encode_batch(texts, parallel=True)
    out["gigatoken"] = time.perf_counter() - start
print(json.dumps(out))
"""


def ceilings(corpus: str, kind: str, model: str, threads: int) -> dict:
    code = CEILING % {"threads": threads}
    result = subprocess.run(
        [sys.executable, "-c", code, corpus, kind, model],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **OFFLINE},
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def _tokenizers(tmp: str, args) -> dict[str, tuple[str, list[str], list[str]]]:
    """kind -> (model path, our flags, Megatron-LM's flags)."""
    models = bench_tokenizers(tmp, args.vocab_size, args.sentencepiece_model, args.hf_tokenizer)
    sp, hf = models["sentencepiece"], models["hf-bpe"]
    return {
        "sentencepiece": (
            sp,
            ["--tokenizer-model", sp],
            ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp],
        ),
        "hf-bpe": (
            hf,
            ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf],
            ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf],
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--target-mb", type=float, default=60.0, help="input for the speed rows")
    parser.add_argument("--large-mb", type=float, default=600.0, help="second input for memory")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--sentencepiece-model", help="use this model instead of training one")
    parser.add_argument("--hf-tokenizer", help="use this folder instead of training one")
    parser.add_argument("--megatron-python", help="a Python that runs Megatron-LM's tools")
    parser.add_argument("--megatron-root", help="a Megatron-LM checkout (its tools/ folder)")
    parser.add_argument("--ceiling-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", default="bench_preprocess.json", help="where to write results")
    args = parser.parse_args(argv)
    with_megatron = bool(args.megatron_python and args.megatron_root)

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        nbytes = write_corpus(corpus, int(args.target_mb * 1e6))
        tiny = os.path.join(tmp, "tiny.jsonl")
        with open(tiny, "w") as f:
            f.write(json.dumps({"text": "def f():\n    return 1\n"}) + "\n")
        kinds = _tokenizers(tmp, args)
        large = None
        for kind, (model, ours, theirs) in kinds.items():
            # (name, command for an input and an output prefix)
            rows = [
                (f"ours --workers {w}", partial(_ours, tokenizer_flags=ours, workers=w))
                for w in (1, 2)
            ]
            rows.append(
                (
                    "ours --workers 2 --tokenize-with auto",
                    partial(_ours, tokenizer_flags=ours, workers=2, tokenize_with="auto"),
                )
            )
            if with_megatron:
                rows.append(
                    (
                        "Megatron-LM preprocess_data.py --workers 2",
                        partial(_megatron, args, False, tokenizer_flags=theirs),
                    )
                )
                if kind != "sentencepiece":  # its fast tool reads Hugging Face tokenizers only
                    rows.append(
                        (
                            "Megatron-LM preprocess_data_fast.py",
                            partial(_megatron, args, True, tokenizer_flags=theirs),
                        )
                    )
            ceiling = ceilings(corpus, kind, model, args.ceiling_threads)
            tokens = ceiling["tokens"]
            startups = {}
            for name, command in rows:
                env = _env(args, name)
                tiny_out = os.path.join(tmp, "t")
                startups[name] = min(measure(command(tiny, tiny_out), env)[0] for _ in range(2))
                seconds, peak = measure(command(corpus, os.path.join(tmp, "o")), env)
                results.append(_row(kind, name, seconds, startups[name], peak, tokens, nbytes))
            for which in ("library", "gigatoken"):
                if which in ceiling:
                    name = f"ceiling: {which} encode, {args.ceiling_threads} threads, in memory"
                    results.append(_row(kind, name, ceiling[which], 0.0, None, tokens, nbytes))
            if args.large_mb and large is None:
                large = os.path.join(tmp, "large.jsonl")
                large_bytes = write_corpus(large, int(args.large_mb * 1e6))
            for name, command in rows if args.large_mb else ():
                if name not in LARGE_ROWS:
                    continue
                seconds, peak = measure(command(large, os.path.join(tmp, "L")), _env(args, name))
                label = f"{name}, {large_bytes / 1e6:.0f} MB input"
                results.append(_row(kind, label, seconds, startups[name], peak, None, large_bytes))
    _print(results, nbytes)
    with open(args.json, "w") as f:
        json.dump(
            {"corpus_mb": nbytes / 1e6, "cpu_cores": os.cpu_count(), "rows": results}, f, indent=1
        )
    return 0


LARGE_ROWS = ("ours --workers 2", "Megatron-LM preprocess_data_fast.py")


def _env(args, name: str) -> dict | None:
    return {"PYTHONPATH": args.megatron_root} if name.startswith("Megatron") else None


def _row(kind, name, seconds, startup, peak, tokens, nbytes) -> dict:
    work = seconds - startup if startup is not None else None
    return {
        "tokenizer": kind,
        "what": name,
        "wall_s": seconds,
        "startup_s": startup,
        "mb_per_s": nbytes / work / 1e6 if work else None,
        "tokens_per_s": tokens / work if work and tokens else None,
        "peak_pss_mb": peak / 1e6 if peak else None,
    }


def _print(results: list[dict], nbytes: int) -> None:
    print(f"input: {nbytes / 1e6:.0f} MB of JSONL text; {os.cpu_count()} CPU cores")
    print(
        f"{'tokenizer':14s} {'what':58s} {'wall s':>7s} {'start s':>7s} {'MB/s':>7s} "
        f"{'x Megatron':>10s} {'of ceiling':>10s} {'peak MB':>8s}"
    )
    for kind in dict.fromkeys(r["tokenizer"] for r in results):
        rows = [r for r in results if r["tokenizer"] == kind]
        anchor = next((r["mb_per_s"] for r in rows if "preprocess_data.py" in r["what"]), None)
        best = max(r["mb_per_s"] for r in rows if r["what"].startswith("ceiling"))
        for r in rows:
            rate = r["mb_per_s"]
            r["x_megatron"] = rate / anchor if rate and anchor else None
            r["fraction_of_best_ceiling"] = rate / best if rate else None
            print(
                f"{kind:14s} {r['what']:58s} {r['wall_s']:7.2f} "
                f"{_f(r['startup_s'], '7.2f')} {_f(rate, '7.1f')} {_f(r['x_megatron'], '9.2f')}x "
                f"{_f(r['fraction_of_best_ceiling'], '9.0%')} {_f(r['peak_pss_mb'], '8.0f')}"
            )
    print(
        "MB/s leaves out each tool's start-up (its one-document run); 'of ceiling' is against "
        "the faster in-memory encode"
    )


def _f(value, spec: str) -> str:
    width = int(spec.split(".")[0].rstrip("%f") or 0)
    return format(value, spec) if value is not None else "-".rjust(width)


if __name__ == "__main__":
    run(main)
