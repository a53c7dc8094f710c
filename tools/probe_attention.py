"""Which attention kernel each of the engine's attention paths runs.

Builds a one-layer model per path (multi-head and grouped-query attention, a sliding window,
bf16 and fp32, with and without dropout), runs a forward and backward pass of the engine's own
model under torch.profiler, and names the engine's choice (engine/model/attention_kernel.py)
and the kernels it saw: FlexAttention, flash, memory-efficient, cuDNN, or the math fallback
(separate matmul and softmax kernels). Prints a
table and writes JSON. `--tiny` runs on the CPU (where only the math and CPU flash paths exist),
to check the script itself.
"""

from __future__ import annotations

import json

import torch

from engine.cli import run_main
from engine.config.arguments import ArgumentParser
from engine.config.model import ModelConfig
from engine.model import BuildContext, GPTModel

PATHS = {
    "MHA bf16": ({}, torch.bfloat16),
    "GQA bf16": ({"group_query_attention": True, "num_query_groups": 4}, torch.bfloat16),
    "MHA bf16 window 512": ({"window_size": "512,0"}, torch.bfloat16),
    "GQA bf16 window 512": (
        {"group_query_attention": True, "num_query_groups": 4, "window_size": "512,0"},
        torch.bfloat16,
    ),
    "MHA bf16 dropout 0.1": ({"attention_dropout": 0.1}, torch.bfloat16),
    "MHA fp32": ({}, torch.float32),
    "GQA fp32": ({"group_query_attention": True, "num_query_groups": 4}, torch.float32),
}

KERNEL_KINDS = (  # (kind, substrings of the kernel or op name), first match wins: cuDNN's
    # own kernels carry "flash" and "fmha" in their names, the memory-efficient ones "fmha";
    # FlexAttention runs generated Triton templates ("triton_tem_fused_..." on a GPU)
    ("flex", ("flex_attention", "triton_tem")),
    ("cudnn", ("cudnn",)),
    ("flash", ("flash",)),
    ("memory-efficient", ("efficient", "fmha", "mem_eff")),
)


def classify(names: list[str]) -> str:
    """The attention kind that a pass's kernel and op names show."""
    lowered = [n.lower() for n in names]
    for kind, marks in KERNEL_KINDS:
        if any(m in n for n in lowered for m in marks):
            return kind
    if any("_scaled_dot_product_attention_math" in n or "softmax" in n for n in lowered):
        return "math"
    return "unknown"


def probe(path: str, device: torch.device, seq: int, hidden: int, heads: int) -> dict:
    overrides, dtype = dict(PATHS[path][0]), PATHS[path][1]
    dropout = overrides.pop("attention_dropout", 0.0)
    cfg = ModelConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=heads,
        seq_length=seq,
        vocab_size=1024,
        hidden_dropout=0.0,
        attention_dropout=dropout,
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        **overrides,
    )
    model = GPTModel(cfg, BuildContext(cfg, params_dtype=dtype, device=device))
    model.train()
    tokens = torch.randint(0, 1024, (2, seq), device=device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        model(tokens, labels=tokens).float().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    names = sorted({e.name for e in prof.events()})
    attention = [n for n in names if n.startswith("aten::_scaled_dot_product") or "flex" in n]
    chosen = model.layers["0"].self_attention.kernel.kind  # engine/model/attention_kernel.py
    return {"path": path, "kind": classify(names), "chosen": chosen, "names": attention}


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--num-attention-heads", type=int, default=16)
    parser.add_argument("--tiny", action="store_true", help="small shapes on the CPU")
    parser.add_argument("--json", default="probe_attention.json")
    args = parser.parse_args(argv)
    if args.tiny:
        args.seq_length, args.hidden_size, args.num_attention_heads = 64, 64, 8
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        print("probe_attention: no CUDA device; run with --tiny on the CPU")
        return 2
    rows = []
    for path in PATHS:
        try:
            rows.append(
                probe(path, device, args.seq_length, args.hidden_size, args.num_attention_heads)
            )
        except Exception as err:  # noqa: BLE001 - a failing path is a row's finding
            rows.append({"path": path, "kind": "failed", "names": [f"{type(err).__name__}: {err}"]})
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}; seq {args.seq_length}")
    print(f"{'path':24s} {'chosen':14s} {'kernel':18s} names seen")
    for row in rows:
        chosen = row.get("chosen", "-")
        print(f"{row['path']:24s} {chosen:14s} {row['kind']:18s} {'; '.join(row['names'])[:140]}")
    with open(args.json, "w") as f:
        json.dump({"device": name, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    run_main(main)
