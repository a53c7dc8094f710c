"""The curation run: per-document stages on every input file in parallel, corpus-wide
deduplication, then PII and the output shards.

    1. per input file (a shard), in worker processes, read in parts of `documents_per_part`
       documents: URL rules and HTML extraction (web pages), language ID, Gopher repetition
       and quality, C4, FineWeb, decontamination;
       the first rule a document fails removes it. Each part's survivors, their hashes
       (document and lines) and MinHash signatures go to
       <output>/work/shard-NNNNN/part-PPPPP/; the shard's folder is written whole or not at
       all;
    2. corpus-wide, in this process: exact duplicates of documents (the first is kept), near
       duplicates by MinHash + LSH (the first of each cluster is kept), then lines seen
       before in the documents that stay (so that a line's kept copy is never in a removed
       document). Signatures are gathered into one file on disk and indexed band by band
       (engine/curation/minhash.py);
    3. per shard, in workers: the kept documents with their duplicate lines dropped and PII
       replaced go to <output>/kept/shard-NNNNN-PPPPP.parquet (one file per part), the
       removed ones with `curate_reason` to <output>/removed/shard-NNNNN-PPPPP.parquet.

A run killed at any point is resumed by running the same command again: finished shards of
steps 1 and 3 are kept, step 2 is recomputed from what step 1 wrote. Memory holds one part
of an input file at a time per worker, and for the deduplication a few tens of bytes per
document and per line (hashes, sort orders; one band of the signatures at a time).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import sys
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import xxhash

from engine.curation import minhash
from engine.curation.config import CurateConfig
from engine.curation.decontamination import ContaminationIndex
from engine.curation.documents import iter_documents, read_parquet_rows, write_parquet
from engine.curation.models.perplexity import BUCKETS, buckets_of, cutoffs_of
from engine.curation.pii import replace_pii
from engine.curation.rules import DocumentRules, added_fields, with_fields
from engine.curation.stats import ShardStats
from engine.curation.web.warc import is_warc
from engine.errors import ConfigError

WARC_PART = 1000  # pages of a WARC file a worker holds at once (documents_per_part caps it)

# step 2's reasons, by code in the decisions files
DECISIONS = {1: "exact_dedup:document", 2: "exact_dedup:lines", 3: "minhash:near_duplicate"}
DECISIONS.update({4 + b: f"perplexity:{name}" for b, name in enumerate(BUCKETS)})


def _fault_after(step: str, k: int) -> None:
    """Fault injection for the kill-and-resume test, inert unless TRIPOD_FAULT_CURATE_KILL_AT
    is `first:K` or `final:K`: the process kills itself once that step has finished shard K."""
    if os.environ.get("TRIPOD_FAULT_CURATE_KILL_AT") == f"{step}:{k}":
        os.kill(os.getpid(), signal.SIGKILL)


def shard_name(k: int) -> str:
    return f"shard-{k:05d}"


def shard_parts(work: str, k: int) -> list[str]:
    """The part folders step 1 wrote for shard k, in order."""
    folder = os.path.join(work, shard_name(k))
    return [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n.startswith("part-")]


def _line_hash(line: str) -> int:
    return xxhash.xxh64_intdigest(line.strip().encode("utf-8"))


def first_pass(k: int, path: str, config: CurateConfig, work: str) -> None:
    """Step 1 for shard k (input file `path`), part by part."""
    final = os.path.join(work, shard_name(k))
    if os.path.exists(final):
        return
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    rules, key = DocumentRules(config, work), config.text_key
    stats, fields = ShardStats(), added_fields(config)
    per_part = config.documents_per_part
    if is_warc(path):  # pages' HTML is large: at most WARC_PART of them held at once
        per_part = min(per_part, WARC_PART)
    parts = iter_documents(path, key, per_part, skipped=stats.skipped)
    for p, (rows, schema) in enumerate(parts):
        kept, removed, reasons = [], [], []
        for row in rows:
            stats.before(row[key])
            judged = rules.web(row, row[key])
            text = judged.text  # a page's extracted text
            if judged.reason is None:
                # line endings as \n: the line rules split on it (FineWeb's would fail on \r\n)
                judged = rules.apply(text.replace("\r\n", "\n").replace("\r", "\n"), row)
            if judged.reason:  # the text judged, with the fields computed so far
                removed.append({**row, key: text, **judged.fields})
                reasons.append(judged.reason)
                stats.removed(judged.reason)
            else:
                kept.append({**row, key: judged.text, **judged.fields})
        folder = os.path.join(tmp, f"part-{p:05d}")
        os.makedirs(folder)
        schema = with_fields(schema, fields)
        write_parquet(os.path.join(folder, "survivors.parquet"), kept, key, schema=schema)
        extra = {"curate_reason": reasons}
        write_parquet(os.path.join(folder, "removed.parquet"), removed, key, extra, schema)
        texts = [row[key] for row in kept]
        hashes = _hashes(texts, config.stage("exact_dedup"))
        np.savez(os.path.join(folder, "hashes.npz"), **hashes, survivors=len(kept))
        if config.stage("minhash"):
            signatures = os.path.join(folder, "signatures.npy")
            minhash.signatures(texts, config.stage("minhash"), signatures)
        if config.stage("perplexity"):  # step 2 buckets them, per language
            np.savez(
                os.path.join(folder, "perplexity.npz"),
                perplexity=np.array([row["perplexity"] for row in kept], np.float64),
                language=np.array([_language(row) for row in kept], str),
            )
    stats.save(os.path.join(tmp, "stats.json"))
    os.replace(tmp, final)
    _fault_after("first", k)


def _language(row: dict) -> str:
    """The language the perplexity cutoffs are computed within ("all" when none is known)."""
    language = row.get("language")
    return language if isinstance(language, str) and language else "all"


def _hashes(texts: list[str], exact) -> dict[str, np.ndarray]:
    """What step 2's exact deduplication needs of the survivors of a shard: each document's
    hash (normalised text) and, for the lines, each line's hash, whether it is blank, and the
    lines of each document (empty arrays for what is off)."""
    documents = exact is not None and exact.documents
    lines = [t.split("\n") for t in texts] if exact is not None and exact.lines else []
    return {
        "document": np.array(
            [xxhash.xxh64_intdigest(minhash.normalise(t).encode()) for t in texts]
            if documents
            else [],
            np.uint64,
        ),
        "line": np.array([_line_hash(x) for ls in lines for x in ls], np.uint64),
        "lines_per_document": np.array([len(ls) for ls in lines], np.int64),
        "blank": np.array([not x.strip() for ls in lines for x in ls], bool),
    }


def dedup_pass(shards: int, config: CurateConfig, work: str) -> None:
    """Step 2: a decisions.npz in every part folder (per survivor a reason code, per line
    whether it is dropped), over all parts of all shards in order."""
    parts = [part for k in range(shards) for part in shard_parts(work, k)]
    loaded = [np.load(os.path.join(part, "hashes.npz")) for part in parts]
    counts = [int(h["survivors"]) for h in loaded]
    documents = np.concatenate([h["document"] for h in loaded] or [np.empty(0, np.uint64)])
    code = np.zeros(sum(counts), np.int8)
    exact = config.stage("exact_dedup")
    if exact is not None and exact.documents and len(documents):
        _, first = np.unique(documents, return_index=True)
        repeat = np.ones(len(documents), bool)
        repeat[first] = False
        code[repeat] = 1
    if config.stage("minhash") and len(code):
        code = _near_duplicates(code, counts, parts, config, work)
    # lines last: a line's first copy must be in a document that stays
    line_hash = np.concatenate([h["line"] for h in loaded] or [np.empty(0, np.uint64)])
    per_doc = np.concatenate([h["lines_per_document"] for h in loaded] or [np.empty(0, np.int64)])
    blank = np.concatenate([h["blank"] for h in loaded] or [np.empty(0, bool)])
    owner = np.repeat(np.arange(len(code)), per_doc) if len(per_doc) else per_doc
    drop = np.zeros(len(line_hash), bool)
    if exact is not None and exact.lines and len(line_hash):
        alive = (code[owner] == 0) & ~blank
        candidates = np.flatnonzero(alive)
        _, first = np.unique(line_hash[candidates], return_index=True)
        drop[candidates] = True
        drop[candidates[first]] = False
        left = np.bincount(owner[alive & ~drop], minlength=len(code))
        has_lines = np.bincount(owner[alive], minlength=len(code)) > 0
        code[(code == 0) & has_lines & (left == 0)] = 2
    bucket = np.full(len(code), -1, np.int8)
    if config.stage("perplexity") is not None:
        code, bucket = _perplexity_buckets(code, parts, config.stage("perplexity"), work)
    starts = np.cumsum([0, *counts])
    line_starts = np.cumsum([0, *[len(h["line"]) for h in loaded]])
    for u, part in enumerate(parts):
        np.savez(
            os.path.join(part, "decisions.npz"),
            code=code[starts[u] : starts[u + 1]],
            drop=drop[line_starts[u] : line_starts[u + 1]],
            bucket=bucket[starts[u] : starts[u + 1]],
        )


def _perplexity_buckets(code, parts: list[str], params, work: str):
    """(codes with the documents of buckets not kept removed, each document's bucket): the
    cutoffs (given, or percentiles of the deduplicated documents' perplexities, per language)
    are saved to work/perplexity.json for the report."""
    scores, languages = [], []
    for part in parts:
        with np.load(os.path.join(part, "perplexity.npz")) as f:
            scores.append(f["perplexity"])
            languages.append(f["language"])
    score = np.concatenate(scores or [np.empty(0)])
    language = np.concatenate(languages or [np.empty(0, str)])
    bucket, cutoffs = np.full(len(code), -1, np.int8), {}
    alive = code == 0
    for name in sorted(set(language[alive].tolist())):
        mine = alive & (language == name)
        cutoffs[name] = cutoffs_of(score[mine], params)
        bucket[mine] = buckets_of(score[mine], cutoffs[name])
    code = code.copy()
    for b, name in enumerate(BUCKETS):
        if name not in params.keep:
            code[bucket == b] = 4 + b
    with open(os.path.join(work, "perplexity.json"), "w") as f:
        json.dump({name: list(pair) for name, pair in cutoffs.items()}, f)
    return code, bucket


def _near_duplicates(code, counts: list[int], parts: list[str], config: CurateConfig, work: str):
    """Documents still kept whose MinHash cluster has an earlier kept member: code 3."""
    alive = np.flatnonzero(code == 0)
    params = config.stage("minhash")
    width = int(np.prod(params.bands_rows()))
    path = os.path.join(work, "signatures-kept.npy")
    gathered = np.lib.format.open_memmap(
        path, mode="w+", dtype=np.uint32, shape=(len(alive), width)
    )
    starts = np.cumsum([0, *counts])
    at = 0
    for u, count in enumerate(counts):
        mine = alive[(alive >= starts[u]) & (alive < starts[u + 1])] - starts[u]
        if count and len(mine):
            sigs = np.load(os.path.join(parts[u], "signatures.npy"), mmap_mode="r")
            gathered[at : at + len(mine)] = sigs[mine]
        at += len(mine)
    gathered.flush()
    first = minhash.duplicate_of(gathered, params)
    code = code.copy()
    code[alive[first != np.arange(len(alive))]] = 3
    del gathered
    os.remove(path)
    return code


def final_pass(k: int, path: str, config: CurateConfig, work: str, output: str) -> None:
    """Step 3 for shard k (input file `path`), part by part."""
    stats_path = os.path.join(work, f"final-{k:05d}.json")
    if os.path.exists(stats_path):
        return
    stats, fields = ShardStats(), added_fields(config)
    parquet = path.lower().endswith(".parquet")  # its schema holds every removed row too
    for p, part in enumerate(shard_parts(work, k)):
        name = f"{shard_name(k)}-{p:05d}.parquet"
        kept, removed, reasons, schema = _final_part(part, config, stats)
        key = config.text_key
        if config.stage("perplexity") is not None:  # a JSONL input's shards lack the field
            schema = with_fields(schema, {"perplexity_bucket": fields["perplexity_bucket"]})
        language = config.stage("language")
        if language is not None and language.output_per_language:
            for code in sorted({row["language"] for row in kept}):
                folder = os.path.join(output, "kept", code)
                os.makedirs(folder, exist_ok=True)
                mine = [row for row in kept if row["language"] == code]
                write_parquet(os.path.join(folder, name), mine, key, schema=schema)
        else:
            write_parquet(os.path.join(output, "kept", name), kept, key, schema=schema)
        extra = {"curate_reason": reasons}
        removed_path = os.path.join(output, "removed", name)
        write_parquet(removed_path, removed, key, extra, schema if parquet else None)
    stats.save(stats_path)
    _fault_after("final", k)


def _final_part(part: str, config: CurateConfig, stats: ShardStats):
    """(kept rows, removed rows, their reasons, the survivors' schema) of one part."""
    key, pii = config.text_key, config.stage("pii")
    survivors, schema = read_parquet_rows(os.path.join(part, "survivors.parquet"))
    removed = read_parquet_rows(os.path.join(part, "removed.parquet"))[0]
    reasons = [row.pop("curate_reason") for row in removed]
    with np.load(os.path.join(part, "decisions.npz")) as decisions:
        codes, drop = decisions["code"], decisions["drop"]  # read once, not per document
        buckets = decisions["bucket"]
    exact = config.stage("exact_dedup")
    by_lines = exact is not None and exact.lines
    kept, line = [], 0
    for row, code, bucket in zip(survivors, codes, buckets, strict=True):
        if bucket >= 0:
            row["perplexity_bucket"] = BUCKETS[bucket]
        text = row[key]
        if by_lines:  # the lines step 2 found earlier in the corpus are dropped
            lines = text.split("\n")
            dropped = drop[line : line + len(lines)]
            line += len(lines)
            text = "\n".join(x for x, gone in zip(lines, dropped, strict=True) if not gone)
        if code:
            removed.append(row)
            reasons.append(DECISIONS[int(code)])
            stats.removed(DECISIONS[int(code)])
            continue
        if pii is not None:
            text, replaced = replace_pii(text, pii)
            stats.pii(replaced)
        stats.after(text)
        kept.append({**row, key: text})
    return kept, removed, reasons, schema


def _check_run(output: str, config: CurateConfig, inputs: list[str]) -> None:
    """<output>/curate.json records the run; a different run there is refused."""
    record = json.loads(json.dumps({"inputs": inputs, "config": config.record()}))
    if os.path.exists(output) and not os.path.isdir(output):
        raise ConfigError(f"--output {output}: is a file; give a folder (new or of this run)")
    try:
        os.makedirs(output, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--output {output}: cannot create it ({err.strerror})") from None
    path = os.path.join(output, "curate.json")
    if os.path.exists(path):
        with open(path) as f:
            if json.load(f) != record:
                raise ConfigError(
                    f"--output {output}: holds a curation of other inputs or another config; "
                    "give a new --output (or delete it) to start afresh"
                )
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)


def curate(inputs: list[str], output: str, config: CurateConfig, workers: int = 1) -> dict:
    """Run the three steps (resuming a killed run in `output`); returns the report."""
    from engine.curation.report import write_report

    _check_run(output, config, inputs)
    work = os.path.join(output, "work")
    for sub in (work, os.path.join(output, "kept"), os.path.join(output, "removed")):
        os.makedirs(sub, exist_ok=True)
    shards = range(len(inputs))
    contamination = config.stage("decontamination")
    if contamination is not None:
        ContaminationIndex.build(contamination).save(os.path.join(work, "contamination.npy"))
    _parallel(first_pass, [(k, inputs[k], config, work) for k in shards], workers)
    dedup_pass(len(inputs), config, work)
    _parallel(final_pass, [(k, inputs[k], config, work, output) for k in shards], workers)
    return write_report(output, work, len(inputs), config)


def _parallel(function, calls: list[tuple], workers: int) -> None:
    if workers <= 1:
        for args in calls:
            function(*args)
        return
    start = "fork" if sys.platform == "linux" else "spawn"
    context = multiprocessing.get_context(start)
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        for future in [pool.submit(function, *args) for args in calls]:
            future.result()
