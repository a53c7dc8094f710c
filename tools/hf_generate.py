"""Greedy generation with transformers from an exported Hugging Face folder (offline)."""

from __future__ import annotations

import argparse
import os

from engine.cli import run_main as run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="folder written by convert_checkpoint.py")
    parser.add_argument("--prompt", default="def ")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    inputs = tokenizer(args.prompt, return_tensors="pt", add_special_tokens=False)
    output = model.generate(
        **inputs,
        max_new_tokens=args.max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    print(f"{type(model).__name__} from {args.model}, greedy:")
    print(tokenizer.decode(output[0], skip_special_tokens=True))
    return 0


if __name__ == "__main__":
    run(main)
