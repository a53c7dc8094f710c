"""torchrun, with the engine's checks before any rank starts and one line per failure.

    python -m engine.launch [torchrun options] -m engine.pretrain [pretraining flags]

takes exactly torchrun's options (it is torch.distributed.run underneath). Before starting any
process it parses the pretraining flags and runs every check that needs no process group
(engine/train/preflight.py) for the world size nnodes x nproc-per-node, so a wrong flag, layout,
path or checkpoint is one line on stderr and exit code 2. Errors found later inside the ranks are
printed once by the ranks themselves (engine/cli.py); when every failed rank exited with code 2
(such an error) the launcher exits 2 without adding torchrun's report, otherwise it names each
failed rank, its exit code or signal, and exits 1. SIGTERM or SIGINT to the launcher (kill,
scancel, docker stop, Ctrl-C) is passed on to the ranks alone (their data-loader workers are in
a process group of their own), which with --exit-signal-handler save at the end of the
iteration before they exit; the launcher waits for them (torchrun's --shutdown-timeout, 30 s
by default) and exits 128 + the signal's number. With --max-restarts N a failed attempt
restarts every rank, from the newest checkpoint when --load equals --save
(engine/train/attempts.py says which attempt and why).
The ranks' CUDA allocator uses expandable segments unless PYTORCH_ALLOC_CONF or
PYTORCH_CUDA_ALLOC_CONF is set. examples/pretrain_gpt.sh launches this way.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys

from engine.cli import run_main
from engine.train.attempts import AttemptReporter, exit_description, listen_to_the_agent
from parallel.errors import one_line

PRETRAIN_MODULE = "engine.pretrain"


def _world_sizes(args) -> list[int]:
    """The world sizes this launch can have: one, or the ends of an elastic range of nodes."""
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    per_node = determine_local_world_size(args.nproc_per_node)
    return sorted({nodes * per_node for nodes in parse_min_max_nnodes(args.nnodes)})


def preflight(args) -> None:
    """The pretraining flags checked for every world size of this launch (ConfigError)."""
    from torch.distributed.run import determine_local_world_size

    from engine.pretrain import parse
    from engine.train.preflight import prepare

    per_node = determine_local_world_size(args.nproc_per_node)
    cfg = parse(args.training_script_args)
    for world_size in _world_sizes(args):
        prepare(cfg, world_size, per_node)
    ckpt = cfg.checkpointing
    if args.max_restarts > 0 and not (ckpt.load and ckpt.save):
        print(
            f"warning: --max-restarts {args.max_restarts} without --load and --save: every "
            "restart trains again from iteration 0; give --load equal to --save to resume",
            file=sys.stderr,
            flush=True,
        )


def _describe(rank, failure) -> str:
    return f"error: rank {rank} {exit_description(failure.exitcode)}; its output is above"


ALLOCATOR_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
# torchrun's agent keeps one key-value store for the whole job unless told otherwise: the ranks
# of a restarted attempt (--max-restarts) then read the keys the failed attempt left (its
# process groups' addresses) and wait in new_group for minutes. With this, every rendezvous
# round (every attempt, on every node alike) gets a new store that its rank 0 hosts.
FRESH_STORE_EACH_ATTEMPT = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def allocator_environment(environ: dict) -> dict:
    """The ranks' CUDA allocator setting: expandable segments (less fragmentation as activation
    sizes vary), unless the user set the allocator's configuration themselves."""
    if any(name in environ for name in ALLOCATOR_VARIABLES):
        return {}
    return {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def rendezvous_network_error(args, err: Exception) -> str:
    """One line for a rendezvous that cannot listen on or reach MASTER_ADDR:MASTER_PORT."""
    where = f"{args.master_addr}:{args.master_port}"
    text = str(err)
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return (
            f"error: port {args.master_port} ({where}) is already in use; give another "
            "MASTER_PORT (--master-port), or leave it out on one machine (--standalone picks a "
            "free one)"
        )
    return f"error: the rendezvous at {where} failed ({one_line(err)}); check MASTER_ADDR/PORT"


def main(argv: list[str] | None = None) -> int:
    import os

    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(argv)
    if args.module and args.training_script == PRETRAIN_MODULE:
        preflight(args)
    # torchrun's agent logs each failed worker and the termination of the others; the ranks
    # say what went wrong themselves, a restart is one line (engine/train/attempts.py), and
    # the final failure is summarised below.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    several_nodes = str(args.nnodes) not in ("1", "1:1")
    listen_to_the_agent(AttemptReporter(socket.gethostname() if several_nodes else None))
    os.environ.update(allocator_environment(os.environ))  # the ranks inherit it
    os.environ.update(FRESH_STORE_EACH_ATTEMPT)
    try:
        run(args)
    except ChildFailedError as err:
        if {failure.exitcode for failure in err.failures.values()} == {2}:
            return 2
        for rank, failure in sorted(err.failures.items()):
            print(_describe(rank, failure), file=sys.stderr, flush=True)
        return 1
    except SignalException as err:  # the ranks were passed the signal and have ended
        name = signal.Signals(err.sigval).name
        print(f"stopped by {name}", file=sys.stderr, flush=True)
        return 128 + int(err.sigval)
    except DistNetworkError as err:
        print(rendezvous_network_error(args, err), file=sys.stderr, flush=True)
        return 2
    except RendezvousError as err:
        print(
            f"error: the nodes did not all join ({one_line(err)}); another node may "
            "have stopped at its start-up checks: see its output",
            file=sys.stderr,
            flush=True,
        )
        return 1
    return 0


if __name__ == "__main__":
    run_main(main)
