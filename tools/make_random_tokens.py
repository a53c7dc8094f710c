"""Write an indexed dataset of uniformly random tokens in a SentencePiece tokenizer's
vocabulary (documents end with its end-of-document token): a dataset that conflicts with real
text, to see gradient interference and surgery on a blend.

  python tools/make_random_tokens.py --tokenizer-model data/quickstart/tokenizer.model \\
      --output-prefix data/noise/noise_text_document --documents 2000
"""

from __future__ import annotations

import argparse
import os

from engine.cli import run_main
from engine.config.arguments import ArgumentParser
from engine.data.prepare.random_tokens import write_random_tokens
from engine.errors import InputError


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokenizer-model", required=True, help="a SentencePiece model")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and .idx")
    parser.add_argument("--documents", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.documents < 1:
        raise InputError(f"--documents {args.documents}: give at least 1")
    if not os.path.isfile(args.tokenizer_model):
        raise InputError(f"--tokenizer-model {args.tokenizer_model}: no such file")
    import sentencepiece

    model = sentencepiece.SentencePieceProcessor(model_file=args.tokenizer_model)
    tokens = write_random_tokens(
        args.output_prefix, model.vocab_size(), model.eos_id(), args.documents, args.seed
    )
    print(f"wrote {args.output_prefix}.bin/.idx: {args.documents} documents, {tokens} tokens")
    return 0


if __name__ == "__main__":
    run_main(main)
