"""Which layout to run: every valid TP/CP/PP(virtual)/DP split (and EP/ETP for a mixture of
experts), micro-batch, recomputation and sharding strategy of a model on a cluster, with its
predicted memory per rank and step time, best first (engine/planning/).

    python tools/plan.py --gpu h100 --gpus 64 --num-layers 32 --hidden-size 4096 \\
        --num-attention-heads 32 --seq-length 4096 --max-position-embeddings 4096 \\
        --vocab-size 32000 --global-batch-size 512
    python tools/plan.py --hf-config path/config.json --seq-length 4096 --global-batch-size 256 \\
        --gpu h200 --gpus 16 --emit-flags
    python tools/plan.py --calibrate cpu.json          # measure this machine (one core per rank)
    python tools/plan.py --calibration cpu.json --gpus 2 ...   # plan for it

The model comes from the engine's own flags (Megatron-LM's names), --hf-config (a Hugging Face
config.json) or --load DIR (a checkpoint's saved arguments, ours or Megatron-LM's). The cluster
is a datasheet row (--gpu) with --gpus and --gpus-per-node, optionally its link bandwidths and a
measured --gemm-efficiency, or a calibration file. --emit-flags prints the engine's flags for
the best layout that fits.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from engine.cli import run_main
from engine.config.arguments import ArgumentParser
from engine.errors import ConfigError


def _arguments(argv):
    parser = ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calibrate", metavar="OUT", help="measure this machine into OUT")
    parser.add_argument("--calibration", help="a file --calibrate wrote: the machine to plan for")
    parser.add_argument("--gpu", help="h100, h200 or a100 (datasheet rates)")
    parser.add_argument("--gpus", type=int, help="devices in the run")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gemm-efficiency", type=float, help="share of the peak GEMMs reach")
    parser.add_argument("--intra-node-bandwidth", type=float, help="GB/s per device per direction")
    parser.add_argument("--inter-node-bandwidth", type=float, help="GB/s per device")
    parser.add_argument("--hf-config", help="the model from a Hugging Face config.json")
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--context-parallel-sizes", type=int, nargs="+", default=[1])
    parser.add_argument("--memory-fraction", type=float, default=0.9, help="of device memory")
    parser.add_argument("--top", type=int, default=10, help="rows to print")
    parser.add_argument("--emit-flags", action="store_true", help="print the best's flags")
    parser.add_argument("--json", help="also write the rows shown here")
    return parser.parse_known_args(argv)


def _machine(args):
    from engine.planning.hardware import Link, datasheet_machine, load_machine

    if args.calibration and args.gpu:
        raise ConfigError("--calibration and --gpu both name the machine; give one")
    if args.calibration:
        return load_machine(args.calibration)
    if not args.gpu:
        raise ConfigError("name the machine: --gpu h100|h200|a100, or --calibration FILE")
    if args.gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node {args.gpus_per_node}: give at least 1")
    if args.gemm_efficiency is not None and not 0 < args.gemm_efficiency <= 1:
        raise ConfigError(f"--gemm-efficiency {args.gemm_efficiency}: give a share in (0, 1]")
    machine = datasheet_machine(args.gpu, args.gpus_per_node)
    if args.gemm_efficiency is not None:
        machine = machine.with_gemm_efficiency(args.gemm_efficiency)
    for flag, name in (("intra_node_bandwidth", "intra"), ("inter_node_bandwidth", "inter")):
        value = getattr(args, flag)
        if value is not None:
            if value <= 0:
                raise ConfigError(f"--{flag.replace('_', '-')} {value}: must be positive")
            machine = replace(
                machine, **{name: Link(getattr(machine, name).latency_s, value * 1e9)}
            )
    return machine


def _model(args, rest: list[str]):
    """The engine's configs from its flags in `rest` with --hf-config's model or --load's."""
    from engine.config.resolve import with_saved_architecture
    from engine.pretrain import parse
    from engine.train.preflight import saved_architecture

    extra = ["--micro-batch-size", "1", "--train-iters", "1"]
    if args.hf_config:
        from engine.interop.hf.architectures import model_config_from_hf
        from engine.planning.flags import model_flags

        try:
            with open(args.hf_config) as f:
                hf = json.load(f)
            model, _ = model_config_from_hf(hf)
        except (OSError, ValueError) as err:
            raise ConfigError(f"--hf-config {args.hf_config}: cannot be read ({err})") from None
        except (KeyError, TypeError, AttributeError) as err:
            raise ConfigError(
                f"--hf-config {args.hf_config}: not a model's config.json ({type(err).__name__}: "
                f"{err}); give the config.json of a Llama-family or GPT-2 model"
            ) from None
        flags = model_flags(model) + rest
    else:
        flags = rest
    if "--max-position-embeddings" not in flags and "--seq-length" in flags:
        flags = flags + ["--max-position-embeddings", flags[flags.index("--seq-length") + 1]]
    from engine.config.arguments import given_flags

    given = given_flags(flags)
    if "--load" in given and "--num-layers" not in given and not args.hf_config:
        flags = flags + ["--use-checkpoint-args"]  # the model from the checkpoint
    cfg = parse(flags + extra)
    saved = saved_architecture(cfg)  # with --use-checkpoint-args: the model of --load
    if saved is not None:
        cfg = with_saved_architecture(cfg, saved)
    if cfg.model.vocab_size is None:
        raise ConfigError("the vocabulary size is unknown: give --vocab-size")
    if not cfg.training.global_batch_size or cfg.training.global_batch_size < 1:
        raise ConfigError(
            "give --global-batch-size (>= 1): the planner splits it into micro-batches"
        )
    return cfg


def _checked(model, layout, world: int) -> None:
    """The engine's own layout checks on the planned flags (engine/config/checks.py)."""
    from engine.config.checks import check_layout_flags
    from engine.config.resolve import resolve
    from engine.planning.flags import layout_flags, model_flags
    from engine.pretrain import parse

    flags = model_flags(model) + layout_flags(model, layout) + ["--train-iters", "1"]
    check_layout_flags(resolve(parse(flags), world), world)


def _gb(value: float) -> str:
    return f"{value / 1e9:.2f}"


def main(argv: list[str] | None = None) -> int:
    args, rest = _arguments(sys.argv[1:] if argv is None else argv)
    if args.calibrate:
        from engine.planning.calibrate import calibrate_cpu

        machine = calibrate_cpu()
        machine.to_json(args.calibrate)
        print(f"wrote {args.calibrate}: {machine.name}")
        if not rest:
            return 0
        args.calibration = args.calibrate
    machine = _machine(args)
    world = machine.gpus_per_node if args.gpus is None else args.gpus
    for flag, value in (("--gpus", world), ("--top", args.top)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: give at least 1")
    for size in args.micro_batch_sizes + args.context_parallel_sizes:
        if size < 1:
            raise ConfigError(f"--micro-batch-sizes / --context-parallel-sizes {size}: give >= 1")
    if not 0 < args.memory_fraction <= 1:
        raise ConfigError(f"--memory-fraction {args.memory_fraction}: give a share in (0, 1]")
    cfg = _model(args, rest)
    from engine.planning.flags import layout_flags
    from engine.planning.search import SearchSpace, plan

    optimizer = cfg.optimizer.optimizer
    if optimizer not in ("adam", "muon"):
        raise ConfigError(
            f"--optimizer {optimizer}: the planner predicts adam and muon (and tries every "
            "sharding strategy itself); give one of them"
        )
    space = SearchSpace(
        cp=tuple(args.context_parallel_sizes), micro_batch_sizes=tuple(args.micro_batch_sizes),
        optimizer=optimizer, muon_tp_mode=cfg.optimizer.muon_tp_mode,
    )  # fmt: skip
    global_batch = cfg.training.global_batch_size
    rows = plan(cfg.model, world, global_batch, machine, space, args.memory_fraction)
    if not rows:
        raise ConfigError(
            f"no layout of this model splits --global-batch-size {global_batch} "
            f"over {world} devices; change the batch or the device count"
        )
    shown = rows[: args.top]
    for row in shown:
        _checked(row["cfg"], row["layout"], world)
    unit = "MFU" if machine.peak_flops else "TFLOP/s"
    moe = cfg.model.is_moe
    print(f"{len(rows)} layouts of {world} x {machine.name}; {sum(r['fits'] for r in rows)} fit in "
          f"{args.memory_fraction:.0%} of {machine.memory_bytes / 1e9:.0f} GB")  # fmt: skip
    experts = f"{'EP':>3s} {'ETP':>3s} " if moe else ""
    print(f"{'TP':>3s} {'CP':>3s} {'PP':>3s} {'v':>3s} {'DP':>4s} {experts}{'mbs':>4s} {'m':>4s} "
          f"{'sharding':18s} {'recompute':9s} {'state GB':>8s} {'act GB':>7s} {'total':>7s} "
          f"{'step s':>8s} {'tokens/s':>10s} {unit:>7s}")  # fmt: skip
    for row in shown:
        lay, mem, pred = row["layout"], row["memory"], row["prediction"]
        state = mem["params"] + mem["grads"] + mem["optimizer"]
        rate = f"{pred['mfu']:.1%}" if machine.peak_flops else f"{pred['tflops']:.3f}"
        fits = "" if row["fits"] else "  does not fit"
        experts = f"{lay.ep:3d} {lay.expert_tp:3d} " if moe else ""
        print(f"{lay.tp:3d} {lay.cp:3d} {lay.pp:3d} {lay.virtual:3d} {lay.dp:4d} {experts}"
              f"{lay.micro_batch_size:4d} {lay.num_microbatches:4d} {lay.strategy:18s} "
              f"{row['recompute']:9s} {_gb(state):>8s} {_gb(mem['activations']):>7s} "
              f"{_gb(mem['total']):>7s} {pred['step_s']:8.3f} {pred['tokens_per_s']:10.0f} "
              f"{rate:>7s}{fits}")  # fmt: skip
    if args.emit_flags:
        best = rows[0]
        if not best["fits"]:
            raise ConfigError(
                "no layout fits in memory; add devices, lower --global-batch-size or "
                "--seq-length, or raise --memory-fraction"
            )
        print(" ".join(layout_flags(best["cfg"], best["layout"])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([_record(r, machine.name) for r in shown], f, indent=1)
    return 0


def _record(row, machine: str) -> dict:
    from dataclasses import asdict

    from engine.planning.flags import layout_flags

    return {
        "machine": machine,
        "layout": asdict(row["layout"]),
        "recompute": row["recompute"],
        "memory_bytes": row["memory"],
        "prediction": row["prediction"],
        "fits": row["fits"],
        "flags": layout_flags(row["cfg"], row["layout"]),
    }


if __name__ == "__main__":
    run_main(main)
