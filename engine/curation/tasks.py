"""A curation run as stages of independent tasks, in order; an executor (local processes, a Ray
cluster, Slurm job arrays: engine/execution/) runs each stage's tasks anywhere that sees
<output>, a stage once the one before it has finished:

    first     per input file (shard): the per-document stages          engine/curation/
    exact     per hash partition: exact duplicate documents             shard_steps.py,
    bands     per MinHash band and key partition: candidate pairs       dedup/documents.py,
    clusters  one task: near-duplicate clusters from every pair         dedup/lines.py,
    lines     per hash partition: duplicate lines                       models/
    decide    per shard: each part's decisions                          perplexity_steps.py
    score     per shard: the perplexity of the documents still kept
    cutoffs   one task: the perplexity buckets' cutoffs
    final     per shard: kept and removed documents, PII

(stages whose stage of the config is off are left out). A task's outputs are written whole,
then its marker <output>/work/done/<stage>-NNNNN: a run killed anywhere and started again
runs only the tasks without a marker, and a task run twice writes the same files.
"""

from __future__ import annotations

import os

from engine.curation.dedup import documents, lines
from engine.curation.dedup.layout import SortedIds, corpus_layout
from engine.curation.models import perplexity_steps
from engine.curation.run_context import RunContext
from engine.curation.shard_steps import final_pass, first_pass
from engine.errors import InputError
from engine.execution.job import Stage, TaskJob, fault_in_task


def stage_graph(ctx: RunContext) -> list[Stage]:
    """The run's stages, in order, with their numbers of tasks."""
    config, partitions, shards = ctx.config, ctx.partitions, ctx.shards
    exact, minhash = config.stage("exact_dedup"), config.stage("minhash")
    stages = [Stage("first", shards)]
    if exact is not None and exact.documents:
        stages.append(Stage("exact", partitions))
    if minhash is not None:
        stages += [Stage("bands", minhash.bands_rows()[0] * partitions), Stage("clusters", 1)]
    if exact is not None and exact.lines:
        stages.append(Stage("lines", partitions))
    stages.append(Stage("decide", shards))
    if config.stage("perplexity") is not None:
        stages += [Stage("score", shards), Stage("cutoffs", 1)]
    stages.append(Stage("final", shards))
    return stages


def curation_job(ctx: RunContext) -> TaskJob:
    """The run as executors see it: markers in work/done/, Slurm logs in work/logs/."""
    done, logs = os.path.join(ctx.work, "done"), os.path.join(ctx.work, "logs")
    return TaskJob("curate", ctx.output, done, logs, run_task, "engine.curation.task_main")


def _outputs(ctx: RunContext, name: str) -> list[str]:
    """The files a stage's tasks wrote, for the stages after it (none when it is off)."""
    stages = {s.name: s for s in stage_graph(ctx)}
    if name not in stages:
        return []
    work, count = ctx.work, stages[name].tasks
    if name == "exact":
        return [documents.exact_path(work, r) for r in range(count)]
    if name == "clusters":
        return [documents.near_path(work)]
    if name == "lines":
        return [lines.lines_path(work, r) for r in range(count)]
    raise ValueError(name)


def run_task(output: str, stage: str, index: int) -> None:
    """Task `index` of `stage` of the run in `output`, unless its marker says it is done."""
    if not os.path.isfile(os.path.join(output, "curate.json")):
        raise InputError(
            f"{output}: no curate.json here; every machine running the run's tasks must see "
            "--output (and the inputs) at the same path: a shared file system"
        )
    ctx = RunContext.load(output)
    done = curation_job(ctx).marker(stage, index)
    if os.path.exists(done):
        return
    os.makedirs(os.path.join(ctx.work, documents.DEDUP_FOLDER), exist_ok=True)
    _run(ctx, stage, index)
    fault_in_task(stage, index)
    os.makedirs(os.path.dirname(done), exist_ok=True)
    open(done, "w").close()


def _run(ctx: RunContext, stage: str, index: int) -> None:
    config, work, partitions = ctx.config, ctx.work, ctx.partitions
    if stage == "first":
        return first_pass(ctx, index)
    if stage == "final":
        cutoffs = None
        if config.stage("perplexity") is not None:
            cutoffs = perplexity_steps.load_cutoffs(work)
        return final_pass(ctx, index, cutoffs)
    if stage == "cutoffs":
        return perplexity_steps.cutoffs_task(work, ctx.shards, config.stage("perplexity"))
    parts = corpus_layout(work, ctx.shards)
    if stage == "exact":
        return documents.exact_task(work, parts, index, partitions)
    if stage == "bands":
        band, r = divmod(index, partitions)
        minhash = config.stage("minhash")
        exact = _outputs(ctx, "exact")
        return documents.band_task(work, parts, band, r, partitions, minhash, exact)
    if stage == "clusters":
        bands = config.stage("minhash").bands_rows()[0]
        edges = [documents.edges_path(work, b, r) for b in range(bands) for r in range(partitions)]
        return documents.clusters_task(work, edges)
    exact = config.stage("exact_dedup")
    by_lines = exact is not None and exact.lines
    if stage == "lines":
        removed = _outputs(ctx, "exact") + _outputs(ctx, "clusters")
        return lines.lines_task(work, parts, index, partitions, removed)
    if stage == "decide":
        exact_ids, near = SortedIds(_outputs(ctx, "exact")), SortedIds(_outputs(ctx, "clusters"))
        dropped = SortedIds(_outputs(ctx, "lines")) if by_lines else None
        for part in (p for p in parts if p.shard == index):
            lines.decide_part(part, exact_ids, near, dropped)
        return None
    if stage == "score":
        params = config.stage("perplexity")
        return perplexity_steps.score_shard(work, parts, index, params, by_lines, config.text_key)
    raise ValueError(f"no curation stage {stage!r}")
