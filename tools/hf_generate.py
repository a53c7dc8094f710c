"""Continuations of a prompt with transformers from an exported Hugging Face folder (offline):
the greedy one, then --num-samples sampled ones with the usual knobs (temperature, top-p,
top-k, repetition penalty), reproducible by --seed."""

from __future__ import annotations

import os

from engine.cli import run_main as run
from engine.config.arguments import ArgumentParser
from engine.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="folder written by convert_checkpoint.py")
    parser.add_argument("--prompt", default="def ")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--num-samples", type=int, default=0, help="sampled continuations")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=0, help="0: no top-k cut")
    parser.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats"
    )
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    if args.temperature <= 0 or not 0 < args.top_p <= 1 or args.repetition_penalty <= 0:
        raise ConfigError(
            "--temperature and --repetition-penalty must be > 0 and --top-p in (0, 1]"
        )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    inputs = tokenizer(args.prompt, return_tensors="pt", add_special_tokens=False)
    common = dict(
        max_new_tokens=args.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        repetition_penalty=args.repetition_penalty,
    )
    output = model.generate(**inputs, do_sample=False, **common)
    print(f"{type(model).__name__} from {args.model}, greedy:")
    print(tokenizer.decode(output[0], skip_special_tokens=True))
    for k in range(args.num_samples):
        torch.manual_seed(args.seed + k)
        output = model.generate(
            **inputs,
            do_sample=True,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            **common,
        )
        print(
            f"-- sample {k + 1} (temperature {args.temperature}, top-p {args.top_p}, "
            f"repetition penalty {args.repetition_penalty}):"
        )
        print(tokenizer.decode(output[0], skip_special_tokens=True))
    return 0


if __name__ == "__main__":
    run(main)
