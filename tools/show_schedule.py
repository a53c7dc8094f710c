"""A pipeline schedule's table as text, its timeline simulated, and (--png) the timeline of a
real training step drawn from what the runtime recorded.

    python tools/show_schedule.py --schedule zb-h1 --pp 4 --microbatches 8
    python tools/show_schedule.py --schedule zb-v --pp 2 --microbatches 8 --png zb-v.png

Text: each rank's list of actions (F forward, B backward, I input gradient, W weight
gradient; "F1.3" is chunk 1 on micro-batch 3), then the timeline the validator simulates with
F = 1, B = 2, I = W = 1 per chunk (parallel/pipeline/validate.py), one character per half
unit, with its bubble per rank. --png runs one step of a GPT (--num-layers x --hidden-size)
on --pp local gloo ranks (one core each; the first step warms up, the second is drawn) with
the runtime's timestamps: per rank a bar per action, idle time left blank.
"""

from __future__ import annotations

from engine.cli import run_main
from engine.config.arguments import ArgumentParser
from parallel.pipeline.tables import GENERATORS, PLACEMENT, build_table, default_chunks
from parallel.pipeline.validate import simulate, validate

COLORS = {"F": "tab:blue", "B": "tab:orange", "I": "tab:red", "W": "tab:green"}


def text(table) -> str:
    lines = [f"{table.name}: p={table.p} ranks, v={table.v} chunks each, m={table.m}"]
    for rank, order in enumerate(table.ranks):
        lines.append(f"rank {rank}: " + " ".join(str(a) for a in order))
    timeline = simulate(table)
    lines.append(f"simulated (F=1, B=2, I=W=1 per chunk; length {timeline.length:g}):")
    for rank, spans in enumerate(timeline.spans):
        row = [" "] * int(timeline.length * 2)
        for action, start, end in spans:
            for t in range(int(start * 2), int(end * 2)):
                row[t] = action.kind if t == int(start * 2) else "-"
        lines.append(f"rank {rank} |{''.join(row)}| bubble {timeline.bubble[rank]:.1%}")
    return "\n".join(lines)


def _measure(rank, world, args):
    import torch
    import torch.distributed as dist

    from engine.model.builder import build_model_chunks
    from engine.planning.bench_setup import bench_model_config
    from engine.train.step import run_schedule
    from parallel.data_parallel.ddp import DistributedDataParallel
    from parallel.pipeline.schedules import get_schedule
    from parallel.state import ParallelState

    state = ParallelState.build(tp=1, pp=world)
    cfg = bench_model_config(args, make_vocab_size_divisible_by=64)
    v = default_chunks(args.schedule)
    placement = PLACEMENT.get(args.schedule, "loop")
    chunks = build_model_chunks(cfg, state, virtual_size=v, placement=placement)
    ddps = [DistributedDataParallel(c, None) for c in chunks]
    stats: dict = {}
    schedule = get_schedule(
        state, virtual_size=v, kind=args.schedule, dtype=torch.float32, stats=stats, trace=True,
        tensor_shape=(args.seq_length, args.micro_batch_size, args.hidden_size),
    )  # fmt: skip
    tokens = torch.randint(0, args.vocab_size, (args.microbatches * args.micro_batch_size,
                                                args.seq_length + 1))  # fmt: skip
    batches = [{"tokens": t[:, :-1], "labels": t[:, 1:]}
               for t in tokens.split(args.micro_batch_size)]  # fmt: skip
    for _ in range(2):
        for ddp in ddps:
            ddp.zero_grad_buffer()
        dist.barrier()
        run_schedule(ddps, batches, schedule, state=state)
    return stats["events"]


def draw(events_per_rank, title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.5 * len(events_per_rank)))
    length = max(end for events in events_per_rank for _, _, end in events) * 1e3
    for rank, events in enumerate(events_per_rank):
        for name, start, end in events:
            ax.barh(rank, (end - start) * 1e3, left=start * 1e3, height=0.8,
                    color=COLORS[name[0]], edgecolor="white", linewidth=0.4)  # fmt: skip
            if (end - start) * 1e3 > 0.03 * length:
                ax.text((start + end) / 2 * 1e3, rank, name, ha="center", va="center",
                        fontsize=6, color="white")  # fmt: skip
    ax.set_yticks(range(len(events_per_rank)), [f"rank {r}" for r in range(len(events_per_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began (measured)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, ["F forward", "B backward", "I input grad", "W weight grad"],
              loc="lower right", bbox_to_anchor=(1.0, 1.0), ncol=4, fontsize=7,
              frameon=False)  # fmt: skip
    ax.set_title(title, fontsize=9, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from parallel.local_ranks import run_local

    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--schedule", default="1f1b", choices=list(GENERATORS))
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--png", help="draw a measured step's timeline here")
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    args = parser.parse_args(argv)
    table = build_table(args.schedule, args.pp, default_chunks(args.schedule), args.microbatches)
    validate(table)
    print(text(table))
    if args.png:
        events = run_local(_measure, args.pp, args, threads=1, timeout=1800)
        title = (f"{args.schedule}: p={args.pp}, m={args.microbatches}, {args.num_layers} layers "
                 f"of {args.hidden_size}, one core per rank")  # fmt: skip
        draw(events, title, args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    run_main(main)
