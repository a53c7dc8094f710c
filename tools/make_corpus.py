"""Write the built-in corpus (Python standard-library sources) as JSONL and Parquet."""

from __future__ import annotations

from engine.cli import run_main as run
from engine.config.arguments import ArgumentParser
from engine.data.prepare.corpus import write_corpus


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument(
        "--output-dir", default="data/corpus", help="folder for stdlib.jsonl/.parquet"
    )
    parser.add_argument("--max-bytes", type=int, default=4_000_000, help="approximate corpus size")
    args = parser.parse_args(argv)
    paths = write_corpus(args.output_dir, args.max_bytes)
    print(f"corpus: {paths['jsonl']}  {paths['parquet']}")
    return 0


if __name__ == "__main__":
    run(main)
