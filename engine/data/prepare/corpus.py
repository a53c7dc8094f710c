"""The built-in corpus: the Python standard library's own .py sources, one document per file.

It needs no download, is a few MB, and is what `make quickstart` and the tests train on. It is
written as JSONL and as Parquet with the same documents ({"text": source, "path": relative}).
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"}


def stdlib_sources(max_bytes: int = 4_000_000) -> list[tuple[str, str]]:
    """(relative path, source) of standard-library modules, spread evenly, about max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*.py")
        if not SKIPPED_DIRS.intersection(p.relative_to(root).parts[:-1])
    )
    total = sum(p.stat().st_size for p in files)
    stride = max(1, round(total / max_bytes))
    documents, size = [], 0
    for path in files[::stride]:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        documents.append((path.relative_to(root).as_posix(), text))
        size += len(text.encode("utf-8"))
        if size >= max_bytes:
            break
    return documents


def write_corpus(out_dir: str | os.PathLike, max_bytes: int = 4_000_000) -> dict[str, str]:
    """Write stdlib.jsonl and stdlib.parquet under out_dir (atomically; reused when present)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"jsonl": str(out / "stdlib.jsonl"), "parquet": str(out / "stdlib.parquet")}
    if all(os.path.isfile(p) for p in paths.values()):
        return paths
    documents = stdlib_sources(max_bytes)
    tmp = f"{paths['jsonl']}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for rel, text in documents:
            f.write(json.dumps({"text": text, "path": rel}, ensure_ascii=False) + "\n")
    os.replace(tmp, paths["jsonl"])
    table = pa.table({"text": [t for _, t in documents], "path": [r for r, _ in documents]})
    tmp = f"{paths['parquet']}.tmp.{os.getpid()}"
    pq.write_table(table, tmp, row_group_size=256)
    os.replace(tmp, paths["parquet"])
    return paths
