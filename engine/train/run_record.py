"""What a checkpoint records of the run that wrote it, so that the run can be reproduced or
compared (tools/diff_runs.py): every config as resolved (each flag's value, given or
default), the flags the command line named, the data files (size and a digest of each
`.idx`, which changes with any other preprocessing of the same text), and the code's version
(the package's and, from a git checkout, its commit)."""

from __future__ import annotations

import dataclasses
import os
import subprocess

from engine.config.configs import SECTIONS, Configs
from engine.data.sources import sources_of
from engine.monitor.metrics import model_flops_per_token
from engine.planning.parameters import parameter_count


def configuration(cfg: Configs) -> dict:
    """{section: {field: value}} of every config, and the flags given."""
    out = {name: _plain(dataclasses.asdict(getattr(cfg, name))) for name, _, _ in SECTIONS}
    out["given"] = sorted(cfg.given)
    return out


def _plain(value):
    """JSON's types: tuples as lists, anything else unusual as its text."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def data_files(cfg: Configs) -> dict:
    """{prefix: {bin_bytes, idx_xxh3}} of the indexed datasets the run reads (Parquet streams
    record their own fingerprint in the data position; mock data has no files)."""
    import xxhash

    out = {}
    sources = sources_of(cfg.data)
    if sources.format != "indexed":
        return out
    for prefix in sources.prefixes():
        record = {}
        if os.path.exists(prefix + ".bin"):
            record["bin_bytes"] = os.path.getsize(prefix + ".bin")
        if os.path.exists(prefix + ".idx"):
            with open(prefix + ".idx", "rb") as f:
                record["idx_xxh3"] = xxhash.xxh3_64(f.read()).hexdigest()
        out[os.path.abspath(prefix)] = record
    return out


def code_version() -> dict:
    """The package version and, where the engine runs from a git checkout, its commit (with
    `+changes` when the working tree differs from it)."""
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    version = {"package": _package_version()}
    try:

        def git(*args: str) -> str:
            done = subprocess.run(
                ["git", "-C", checkout, *args],
                capture_output=True, text=True, timeout=10,
            )  # fmt: skip
            return done.stdout.strip() if done.returncode == 0 else ""

        commit = git("rev-parse", "HEAD")
        if commit:
            version["commit"] = commit + ("+changes" if git("status", "--porcelain") else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    return version


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tripod")
    except PackageNotFoundError:
        return "unknown"


def run_record(cfg: Configs) -> dict:
    """The whole record, made once at the run's start."""
    return {"configuration": configuration(cfg), "data_files": data_files(cfg),
            "code": code_version()}  # fmt: skip


def log_description(cfg: Configs, tp: int) -> dict:
    """What tools reading the run's --log-jsonl file need beside it (engine/monitor/run_log.py):
    the parameter count, the training FLOPs per token (the engine's count, as for MFU), the
    sequence length, the seed and the configuration."""
    count = parameter_count(cfg.model, tp)
    flops = model_flops_per_token(cfg.model, cfg.model.padded_vocab_size(tp))
    return {
        "parameters": count.total, "embedding_parameters": count.embedding,
        "active_parameters": count.active, "flops_per_token": flops,
        "seq_length": cfg.model.seq_length, "seed": cfg.training.seed,
        "configuration": configuration(cfg),
    }  # fmt: skip


def flat_settings(cfg: Configs, state) -> dict:
    """The run's settings as one flat mapping (the wandb run's config)."""
    record = {"world_size": state.world_size, "data_parallel_size": state.dp_size}
    for name, _, _ in SECTIONS:
        if name != "megatron":
            record.update(dataclasses.asdict(getattr(cfg, name)))
    return record
