"""The executor flags of tools/curate.py (and tools/preprocess_data.py): --executor
local|ray|slurm with each one's options, checked in one line each."""

from __future__ import annotations

from engine.errors import ConfigError


def add_executor_arguments(parser) -> None:
    parser.add_argument("--executor", choices=("local", "ray", "slurm"), default="local",
                        help="where the tasks run: this machine's processes, a Ray cluster, "
                        "Slurm job arrays")  # fmt: skip
    parser.add_argument("--ray-address", help="host:port of a running Ray cluster's head "
                        "(default: a local cluster started for the run)")  # fmt: skip
    parser.add_argument("--max-retries", type=int, default=2,
                        help="times a task whose process died is run again")  # fmt: skip
    parser.add_argument("--slurm-partition")
    parser.add_argument("--slurm-time", help="each array task's --time, e.g. 4:00:00")
    parser.add_argument("--slurm-cpus-per-task", type=int, default=1)
    parser.add_argument("--slurm-mem", help="each array task's --mem, e.g. 8G")


def executor_from_arguments(args):
    """The executor the flags name (None: the local one, built by the run)."""
    if args.max_retries < 0:
        raise ConfigError(f"--max-retries {args.max_retries}: give 0 or more")
    if args.ray_address and args.executor != "ray":
        raise ConfigError("--ray-address: only with --executor ray")
    slurm_flags = [f for f in ("slurm_partition", "slurm_time", "slurm_mem") if getattr(args, f)]
    if (slurm_flags or args.slurm_cpus_per_task != 1) and args.executor != "slurm":
        name = slurm_flags[0] if slurm_flags else "slurm_cpus_per_task"
        raise ConfigError(f"--{name.replace('_', '-')}: only with --executor slurm")
    if args.slurm_cpus_per_task < 1:
        raise ConfigError(f"--slurm-cpus-per-task {args.slurm_cpus_per_task}: give at least 1")
    if args.executor == "local":
        from engine.execution.local import LocalExecutor

        return LocalExecutor(args.workers, args.max_retries)
    if args.executor == "ray":
        from engine.execution.ray_cluster import RayExecutor, check_address

        if args.ray_address:
            check_address(args.ray_address)
        return RayExecutor(args.ray_address, args.max_retries, args.workers)
    from engine.execution.slurm import SlurmExecutor, SlurmOptions

    options = SlurmOptions(args.slurm_partition, args.slurm_time, args.slurm_cpus_per_task,
                           args.slurm_mem, args.max_retries)  # fmt: skip
    return SlurmExecutor(options)
