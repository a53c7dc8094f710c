"""Pretraining entry point: `python -m engine.pretrain <Megatron-LM flags>`, launched by
torchrun (see examples/pretrain_gpt.sh). `main(argv)` parses and checks every flag before any
process group starts, then sets up the run and trains. `--check-megatron-args <flags or a
script>` first: what each Megatron-LM flag will do here (engine/config/megatron/report.py).
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from engine.checkpoint.files import find_latest
from engine.cli import run_main
from engine.config.arguments import check_aliases, given_flags, other_names, parse_configs
from engine.config.checks import check_configs
from engine.config.configs import SECTIONS, Configs, configs_from
from engine.config.megatron.compat import no_effect_line
from engine.config.resolve import resolve
from engine.errors import ConfigError, UserError
from engine.monitor.run_log import write_description
from engine.planning.parameters import parameter_count
from engine.train.attempts import attempt_line
from engine.train.finite_weights import NonFiniteWeights
from engine.train.loop import NaNLimit, finish, train
from engine.train.preflight import prepare
from engine.train.run_record import log_description
from engine.train.setup import setup
from parallel.state import ParallelState, init_distributed


def parse(argv: list[str] | None) -> Configs:
    """The command line as configs (not yet resolved: engine/train/preflight.py's prepare)."""
    argv = sys.argv[1:] if argv is None else argv
    groups = [(cls, title) for _, cls, title in SECTIONS]
    check_aliases(argv, groups)
    parsed = parse_configs(argv, groups, description=__doc__, enforce_required=True)
    return configs_from(parsed, given_flags(argv, other_names(groups)))


def _fewest_data_parallel(p) -> int:
    """The smallest DP that the optimizer instances divide DP x CP into and expert tensor x
    expert parallelism divides TP x CP x DP into."""
    instances = max(p.num_distributed_optimizer_instances, 1)
    dense = instances // math.gcd(instances, p.context_parallel_size)
    experts = max(p.expert_model_parallel_size, 1) * max(p.expert_tp_size, 1)
    stage = p.tensor_model_parallel_size * p.context_parallel_size
    folded = experts // math.gcd(experts, stage)
    return dense * folded // math.gcd(dense, folded)


def values_problem(argv: list[str]) -> str | None:
    """What the parse and the configuration checks of a command line refuse (on the fewest
    ranks its layout takes; not its files, tokenizer or devices, which the machine running the
    report may lack), as one line; None if nothing."""
    import contextlib
    import io

    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            cfg = parse(argv)
            p = cfg.parallel
            world = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
            world *= p.context_parallel_size * _fewest_data_parallel(p)
            check_configs(resolve(cfg, world), world)
    except ConfigError as err:
        return str(err)
    except SystemExit:
        return errors.getvalue().strip()
    return None


def train_and_finish(run) -> int:
    """The training loop, then the final evaluation and save; the exit code."""
    code, completed = 0, True
    try:
        train(run)
    except NaNLimit as stop:
        run.writer.print(str(stop))
        code = 1
    except NonFiniteWeights as stop:
        run.writer.print(str(stop))
        code, completed = 1, False
    finish(run, completed)
    return code


def interrupted_line(save: str | None) -> str:
    """'interrupted; latest checkpoint N' (the newest complete one under --save)."""
    try:
        latest = find_latest(save)
    except UserError:
        latest = None
    if latest is None:
        return "interrupted; no checkpoint saved" + (f" in {save}" if save else "")
    return f"interrupted; latest checkpoint {latest} in {save}"


def main(argv: list[str] | None = None) -> int:
    started = time.time()  # --exit-duration-in-mins counts from the process's start
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--check-megatron-args"]:  # a migration report, nothing trained
        from engine.config.megatron.report import report

        return report(argv[1:], values_problem)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = prepare(parse(argv), world_size)
    level = cfg.logging.logging_level  # as Megatron-LM: the flag, else its variable
    if level is None and os.environ.get("MEGATRON_LOGGING_LEVEL"):
        level = int(os.environ["MEGATRON_LOGGING_LEVEL"])
    if level is not None:
        logging.getLogger().setLevel(level)
    if cfg.runtime.deterministic_mode:  # before any cuBLAS handle exists
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    started_here = not dist.is_initialized()
    timeout = cfg.parallel.distributed_timeout_minutes
    _, _, device = init_distributed(cfg.runtime.device, timeout)
    if device.type == "cpu":  # ranks sharing a CPU get one core each
        local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local, 1)))
    state = ParallelState.build(
        cfg.parallel.tensor_model_parallel_size,
        cfg.parallel.pipeline_model_parallel_size,
        cp=cfg.parallel.context_parallel_size,
        device=device,
        timeout_minutes=cfg.parallel.distributed_timeout_minutes,
        pp_inside_dp=cfg.parallel.use_tp_pp_dp_mapping,
        optimizer_instances=cfg.parallel.num_distributed_optimizer_instances,
        ep=cfg.parallel.expert_model_parallel_size,
        etp=cfg.parallel.expert_tp_size,
    )
    run = setup(cfg, state, started)
    run.writer.print(parameter_count(cfg.model, state.tp_size).describe())
    if run.writer.enabled and cfg.logging.log_jsonl:
        write_description(cfg.logging.log_jsonl, log_description(cfg, state.tp_size))
    attempt = attempt_line()  # a restart by torchrun's --max-restarts says which and why
    if attempt:
        run.writer.print(attempt)
    accepted = no_effect_line(cfg.megatron, cfg.model, cfg.runtime, cfg.parallel)
    if accepted:
        run.writer.print(accepted)
    try:
        code = train_and_finish(run)
    except KeyboardInterrupt:  # a second signal, or Ctrl-C without --exit-signal-handler
        # the process ends at once: a background thread that the workers' end breaks (the
        # one sharing batches' file descriptors with them, mid-handshake) reports nothing
        threading.excepthook = lambda args: None
        for child in multiprocessing.active_children():  # data-loader workers end quietly
            child.terminate()
        if state.rank == 0:
            print(interrupted_line(cfg.checkpointing.save), file=sys.stderr, flush=True)
        os._exit(130)  # peers may be in a collective and a save's threads half done
    if started_here and dist.is_initialized():
        dist.destroy_process_group()
    return code


if __name__ == "__main__":
    run_main(main)
