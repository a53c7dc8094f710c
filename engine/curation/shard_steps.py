"""The per-shard steps of a curation run (one input file each; engine/curation/tasks.py lists
every step):

    first   the per-document stages (engine/curation/rules.py), part by part of
            `documents_per_part` documents: each part's survivors, the documents removed (with
            `curate_reason`), the survivors' hashes (document, lines) and MinHash signatures
            go to <output>/work/shard-NNNNN/part-PPPPP/; the shard's folder is written whole
            or not at all;
    final   after the corpus-wide steps: the kept documents, their duplicate lines dropped and
            PII replaced, to <output>/kept/shard-NNNNN-PPPPP.parquet (per language on
            request: kept/<language>/), the removed ones with `curate_reason` to
            <output>/removed/.

Memory holds one part of an input file at a time.
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import numpy as np
import xxhash

from engine.curation import minhash
from engine.curation.atomic import remove_stale_folders, temporary
from engine.curation.dedup.layout import PARTS_FILE, shard_name
from engine.curation.documents import iter_documents, read_parquet_rows, write_parquet
from engine.curation.models.perplexity import BUCKETS, buckets_of
from engine.curation.pii import replace_pii
from engine.curation.rules import DocumentRules, added_fields, with_fields
from engine.curation.run_context import RunContext
from engine.curation.stats import ShardStats
from engine.curation.web.warc import is_warc

WARC_PART = 1000  # pages of a WARC file a worker holds at once (documents_per_part caps it)

# the corpus-wide steps' reasons, by code in the decisions files
DECISIONS = {
    1: "exact_dedup:document", 2: "exact_dedup:lines", 3: "minhash:near_duplicate",
    4: "perplexity:head", 5: "perplexity:middle", 6: "perplexity:tail",
}  # fmt: skip
BUCKET_CODE = 4  # + the bucket's number


def fault_after(step: str, k: int) -> None:
    """Fault injection for the kill-and-resume test, inert unless TRIPOD_FAULT_CURATE_KILL_AT
    is `first:K` or `final:K`: the process kills itself once that step has finished shard K."""
    if os.environ.get("TRIPOD_FAULT_CURATE_KILL_AT") == f"{step}:{k}":
        os.kill(os.getpid(), signal.SIGKILL)


def shard_parts(work: str, k: int) -> list[str]:
    """The part folders step 1 wrote for shard k, in order."""
    folder = os.path.join(work, shard_name(k))
    return [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n.startswith("part-")]


def _line_hash(line: str) -> int:
    return xxhash.xxh64_intdigest(line.strip().encode("utf-8"))


def first_pass(ctx: RunContext, k: int) -> None:
    """Step 1 for shard k, part by part."""
    config, work, path = ctx.config, ctx.work, ctx.inputs[k]
    final = os.path.join(work, shard_name(k))
    if os.path.exists(final):
        return
    remove_stale_folders(final)
    tmp = temporary(final)  # this attempt's own: another may be writing its
    os.makedirs(tmp)
    rules, key = DocumentRules(config, work), config.text_key
    stats, fields = ShardStats(), added_fields(config)
    blank = dict.fromkeys(fields)  # an input's own values of these fields are not kept
    per_part = config.documents_per_part
    if is_warc(path):  # pages' HTML is large: at most WARC_PART of them held at once
        per_part = min(per_part, WARC_PART)
    records = []
    for p, (rows, schema) in enumerate(iter_documents(path, key, per_part, skipped=stats.skipped)):
        kept, removed, reasons = [], [], []
        for row in rows:
            stats.before(row[key])
            judged = rules.web(row, row[key])
            text = judged.text  # a page's extracted text
            if judged.reason is None:
                # line endings as \n: the line rules split on it (FineWeb's would fail on \r\n)
                judged = rules.apply(text.replace("\r\n", "\n").replace("\r", "\n"), row)
            if judged.reason:  # the text judged, with the fields computed so far
                removed.append({**row, **blank, key: text, **judged.fields})
                reasons.append(judged.reason)
                stats.removed(judged.reason)
            else:
                kept.append({**row, **blank, key: judged.text, **judged.fields})
        folder = os.path.join(tmp, f"part-{p:05d}")
        os.makedirs(folder)
        schema = with_fields(schema, fields)
        write_parquet(os.path.join(folder, "survivors.parquet"), kept, key, schema=schema)
        extra = {"curate_reason": reasons}
        write_parquet(os.path.join(folder, "removed.parquet"), removed, key, extra, schema)
        texts = [row[key] for row in kept]
        hashes = _hashes(texts, config.stage("exact_dedup"))
        np.savez(os.path.join(folder, "hashes.npz"), **hashes)
        if config.stage("minhash"):  # the signatures, and each band's key for the bands tasks
            signatures = os.path.join(folder, "signatures.npy")
            sigs = minhash.signatures(texts, config.stage("minhash"), signatures)
            np.save(
                os.path.join(folder, "band_keys.npy"),
                minhash.band_keys(sigs, config.stage("minhash")),
            )
        records.append({"survivors": len(kept), "lines": len(hashes["line"])})
    with open(os.path.join(tmp, PARTS_FILE), "w") as f:
        json.dump(records, f)
    stats.save(os.path.join(tmp, "stats.json"))
    try:
        os.replace(tmp, final)
    except OSError:  # another attempt put its folder there first: the same files
        if not os.path.isdir(final):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    fault_after("first", k)


def _hashes(texts: list[str], exact) -> dict[str, np.ndarray]:
    """What the exact deduplication needs of the survivors of a part: each document's hash
    (normalised text) and, for the lines, each line's hash, whether it is blank, and the lines
    of each document (empty arrays for what is off)."""
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


def kept_texts(survivors: list[dict], key: str, drop: np.ndarray, by_lines: bool) -> list[str]:
    """Each survivor's text without the lines the corpus-wide step dropped."""
    if not by_lines:
        return [row[key] for row in survivors]
    out, at = [], 0
    for row in survivors:
        lines = row[key].split("\n")
        dropped = drop[at : at + len(lines)]
        at += len(lines)
        out.append("\n".join(x for x, gone in zip(lines, dropped, strict=True) if not gone))
    return out


def final_pass(ctx: RunContext, k: int, cutoffs: dict | None) -> None:
    """The last step for shard k, part by part (`cutoffs`: the perplexity buckets' per
    language)."""
    config, work, output = ctx.config, ctx.work, ctx.output
    stats_path = os.path.join(work, f"final-{k:05d}.json")
    if os.path.exists(stats_path):
        return
    stats, fields = ShardStats(), added_fields(config)
    parquet = ctx.inputs[k].lower().endswith(".parquet")  # its schema holds every removed row
    language = config.stage("language")
    for p, part in enumerate(shard_parts(work, k)):
        name = f"{shard_name(k)}-{p:05d}.parquet"
        kept, removed, reasons, schema = _final_part(part, config, stats, cutoffs)
        key = config.text_key
        schema = with_fields(schema, fields)  # a JSONL input's shards may lack some
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
    fault_after("final", k)


def _final_part(part: str, config, stats: ShardStats, cutoffs: dict | None):
    """(kept rows, removed rows, their reasons, the survivors' schema) of one part."""
    key, pii = config.text_key, config.stage("pii")
    survivors, schema = read_parquet_rows(os.path.join(part, "survivors.parquet"))
    removed = read_parquet_rows(os.path.join(part, "removed.parquet"))[0]
    reasons = [row.pop("curate_reason") for row in removed]
    with np.load(os.path.join(part, "decisions.npz")) as decisions:
        codes, drop = decisions["code"].copy(), decisions["drop"]
    exact = config.stage("exact_dedup")
    texts = kept_texts(survivors, key, drop, exact is not None and exact.lines)
    perplexity = config.stage("perplexity")
    if perplexity is not None:
        with np.load(os.path.join(part, "perplexity.npz")) as f:
            scores, languages = f["perplexity"], f["language"]
        for i in np.flatnonzero(codes == 0):
            bucket = int(buckets_of(scores[i : i + 1], cutoffs[str(languages[i])])[0])
            survivors[i]["perplexity"] = float(scores[i])
            survivors[i]["perplexity_bucket"] = BUCKETS[bucket]
            if BUCKETS[bucket] not in perplexity.keep:
                codes[i] = BUCKET_CODE + bucket
    kept = []
    for row, text, code in zip(survivors, texts, codes, strict=True):
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
