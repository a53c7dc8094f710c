"""The curation run: its stages (engine/curation/tasks.py) run by an executor, then the report.

    1. per input file (a shard): URL rules and HTML extraction (web pages), language ID,
       Gopher, C4, FineWeb, bad words, the classifiers, decontamination (the first rule a
       document fails removes it); survivors, hashes and MinHash signatures to
       <output>/work/shard-NNNNN/;
    2. corpus-wide, as tasks that each take a share (hash partitions, MinHash bands): exact
       duplicates of documents (the first is kept), near duplicates (the first of each
       cluster is kept), then lines seen before in the documents that stay; each part's
       decisions; then the perplexity of the documents still kept and its buckets' cutoffs;
    3. per shard: the kept documents, duplicate lines dropped and PII replaced, to
       <output>/kept/ (per language on request), the removed ones with `curate_reason` to
       <output>/removed/.

The outputs do not depend on the executor, the workers or the number of tasks. A run killed
at any point is resumed by running the same command again: the tasks that finished are kept.
Memory holds one part of an input file per worker, and a share of the hashes per
corpus-wide task.
"""

from __future__ import annotations

import os

from engine.curation.config import CurateConfig
from engine.curation.decontamination import ContaminationIndex
from engine.curation.models.perplexity import prepare_reference
from engine.curation.run_context import RECORD, RunContext
from engine.curation.tasks import curation_job, stage_graph
from engine.errors import ConfigError
from engine.execution.job import keep_record

MAX_DEDUP_TASKS = 64


def default_dedup_tasks(inputs: int) -> int:
    """Partitions of the corpus-wide steps: one per input file, up to MAX_DEDUP_TASKS."""
    return max(1, min(inputs, MAX_DEDUP_TASKS))


def _check_run(ctx: RunContext) -> None:
    """<output>/curate.json records the run; a different run there is refused."""
    output = ctx.output
    if os.path.exists(output) and not os.path.isdir(output):
        raise ConfigError(f"--output {output}: is a file; give a folder (new or of this run)")
    try:
        os.makedirs(output, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--output {output}: cannot create it ({err.strerror})") from None
    refusal = (
        f"--output {output}: holds a curation of other inputs, another config, another "
        "--dedup-tasks or models changed since; give a new --output (or delete it) to start "
        "afresh"
    )
    keep_record(os.path.join(output, RECORD), ctx.record(), refusal)


def curate(
    inputs: list[str],
    output: str,
    config: CurateConfig,
    workers: int = 1,
    executor=None,
    dedup_tasks: int | None = None,
) -> dict:
    """Run the stages (resuming a killed run in `output`) with `executor` (the local one with
    `workers` processes by default); returns the report."""
    from engine.curation.report import write_report
    from engine.execution.local import LocalExecutor

    partitions = dedup_tasks or default_dedup_tasks(len(inputs))
    ctx = RunContext(os.path.abspath(output), tuple(inputs), config, partitions)
    _check_run(ctx)
    for sub in (ctx.work, os.path.join(output, "kept"), os.path.join(output, "removed")):
        os.makedirs(sub, exist_ok=True)
    contamination = config.stage("decontamination")
    if contamination is not None:  # built afresh: a killed run may have left half of it
        ContaminationIndex.build(contamination).save(os.path.join(ctx.work, "contamination.npy"))
    if config.stage("perplexity") is not None:
        prepare_reference(config.stage("perplexity"), ctx.work)
    (executor or LocalExecutor(workers, retries=2)).run(curation_job(ctx), stage_graph(ctx))
    return write_report(output, ctx.work, len(inputs), config)
