"""A corpus of real text found on this machine, for tests and benchmarks of curation (no
download): the docstrings of the standard library (English prose), the descriptions of the
installed packages (Markdown and reStructuredText: lists, tables, code) and standard-library
source files (code, which web-text rules mostly reject). Sorted, so the same installation
gives the same corpus."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import sysconfig

_SKIPPED = {"test", "tests", "site-packages", "dist-packages", "idlelib", "turtledemo"}


def _docstrings(path: str, min_chars: int) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef | ast.FunctionDef))]
    docs = (ast.get_docstring(n) for n in nodes)
    return [d for d in docs if d and len(d) >= min_chars]


def local_documents(max_documents: int = 4000, min_chars: int = 200) -> list[dict]:
    """Up to `max_documents` {"text", "source"} records, interleaving the three kinds."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(
        os.path.join(root, name)
        for root, dirs, names in os.walk(stdlib)
        if not any(part in _SKIPPED for part in os.path.relpath(root, stdlib).split(os.sep))
        for name in names
        if name.endswith(".py") and not name.startswith("_")
    )
    prose = []  # each kind needs at most max_documents entries for the interleaving below
    for path in files:
        if len(prose) >= max_documents:
            break
        source = f"docstring:{os.path.relpath(path, stdlib)}"
        prose.extend({"text": d, "source": source} for d in _docstrings(path, min_chars))
    described = sorted(
        (d.metadata["Name"] or "", d.metadata.get_payload() or "")
        for d in importlib.metadata.distributions()
    )
    markup = [{"text": t, "source": f"package:{n}"} for n, t in described if len(t) >= min_chars]
    code = []
    for path in files[:max_documents]:
        with open(path, encoding="utf-8", errors="replace") as f:
            code.append({"text": f.read(), "source": f"source:{os.path.relpath(path, stdlib)}"})
    out, kinds = [], [prose, markup, code]
    for i in range(max(len(k) for k in kinds)):
        out.extend(k[i] for k in kinds if i < len(k))
    return out[:max_documents]
