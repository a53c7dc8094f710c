"""Tokens and epochs per dataset of a planned run: pass the run's own flags (--data-path with
names, --data-mix-schedule, --split, --seq-length, --global-batch-size, --train-iters or
--train-samples, ...). Warns about a dataset seen more than --max-epochs times (default 4:
up to about 4 epochs of repeated data train almost as well as fresh data, Muennighoff et al.
2023, "Scaling Data-Constrained Language Models").

    python tools/mix_report.py --data-path 0.7 web:data/web 0.3 code:data/code \\
        --seq-length 2048 --global-batch-size 512 --train-iters 10000 [--json report.json]
"""

from __future__ import annotations

import json
import sys

from engine.cli import run_main
from engine.config.arguments import ArgumentParser, parse_configs
from engine.config.data import DataConfig
from engine.config.resolve import with_length
from engine.config.training import TrainingConfig
from engine.data.mix.report import plan_mix
from engine.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    own = ArgumentParser(description=__doc__, add_help=False)
    own.add_argument("--max-epochs", type=float, default=4.0)
    own.add_argument("--json", help="also write the report here")
    own.add_argument("--seq-length", type=int, required=True)
    args, rest = own.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.seq_length < 1:
        raise ConfigError("--seq-length must be at least 1")
    configs = parse_configs(rest, [(DataConfig, "data"), (TrainingConfig, "training")], __doc__)
    data = configs[DataConfig]
    train = with_length(configs[TrainingConfig], 1, args.seq_length)
    batches = train.batch_schedule(1, args.seq_length)
    plans, starts = plan_mix(data, train, args.seq_length, batches)
    print(f"{train.train_iters} iterations, global batch {batches.final}, seq {args.seq_length}")
    header = ["dataset", *[f"weight@{s}" for s in starts], "tokens", "planned", "epochs"]
    rows = [
        [
            p.name,
            *[f"{w:.3f}" for w in p.weights],
            f"{p.tokens_available:,}",
            f"{p.tokens_planned:,}",
            f"{p.epochs:.2f}",
        ]
        for p in plans
    ]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print(
            "  ".join(
                str(c).rjust(w) if i else str(c).ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=False))
            )
        )
    for p in plans:
        if p.epochs > args.max_epochs:
            print(
                f"warning: {p.name} ({p.prefix}) would be seen {p.epochs:.1f} times, more than "
                f"--max-epochs {args.max_epochs:g}; lower its weight or add data",
                file=sys.stderr,
            )
    if args.json:
        report = {
            "train_iters": train.train_iters,
            "phase_starts": starts,
            "datasets": [
                {
                    "name": p.name,
                    "prefix": p.prefix,
                    "weights": list(p.weights),
                    "tokens_available": p.tokens_available,
                    "tokens_planned": p.tokens_planned,
                    "epochs": p.epochs,
                }
                for p in plans
            ],
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    run_main(main)
