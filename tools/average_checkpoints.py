"""Average a run's last checkpoints into a new one (uniform, or --ema DECAY weights the newest
most): weights only, any layout in, one rank out; it evaluates and exports like any other and
resumes training with --finetune.

    python tools/average_checkpoints.py --load SAVE_DIR --last 5 --output AVERAGED_DIR
"""

from __future__ import annotations

from engine.checkpoint.average import average_checkpoints
from engine.cli import run_main
from engine.config.arguments import ArgumentParser


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", required=True, help="the run's --save folder")
    parser.add_argument("--last", type=int, required=True, help="how many of its newest")
    parser.add_argument("--output", required=True, help="a new folder for the average")
    parser.add_argument("--ema", type=float, help="weights decaying by this per checkpoint back")
    args = parser.parse_args(argv)
    done = average_checkpoints(args.load, args.last, args.output, args.ema)
    pairs = zip(done["iterations"], done["weights"], strict=True)
    weights = ", ".join(f"{it}: {w:.3f}" for it, w in pairs)
    print(f"averaged iterations {weights} -> {done['checkpoint']}")
    return 0


if __name__ == "__main__":
    run_main(main)
