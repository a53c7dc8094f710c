"""The README stays a front door (at most ~300 lines) and every link in it and in docs/
points at a file that exists."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _pages() -> list[str]:
    docs = os.path.join(ROOT, "docs")
    return [os.path.join(ROOT, "README.md")] + [
        os.path.join(docs, name) for name in sorted(os.listdir(docs)) if name.endswith(".md")
    ]


def test_the_readme_is_short():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert sum(1 for _ in f) <= 300


def test_every_link_points_at_a_file():
    missing = []
    for page in _pages():
        with open(page, encoding="utf-8") as f:
            text = f.read()
        for target in LINK.findall(text):
            if "://" in target:
                continue
            if not os.path.exists(os.path.join(os.path.dirname(page), target)):
                missing.append(f"{os.path.relpath(page, ROOT)} -> {target}")
    assert missing == []


def test_the_readme_links_a_page_for_every_task():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    for page in ("curate", "tokenize", "preprocess", "plan", "train", "watch", "checkpoints"):
        assert f"docs/{page}.md" in text, page
    for page in ("evaluate", "export", "megatron", "architecture"):
        assert f"docs/{page}.md" in text, page
