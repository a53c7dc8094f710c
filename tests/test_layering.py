"""The shape of the code: imports point downward and files stay small.

`parallel/` (building blocks over torch.distributed) never imports `engine/` (the training
engine), `engine/config/` imports nothing of the engine above it, the engine's root holds only
its entry points and error types, and no module grows past 500 lines.
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_ROOT_MODULES = {"__init__.py", "cli.py", "errors.py", "launch.py", "pretrain.py"}
# what engine/config/ may import of the engine: itself, the error types and the tokenizer's
# config (the one config that lives with its part, since the tools share it)
CONFIG_MAY_IMPORT = ("engine.config", "engine.errors", "engine.config.tokenizer")


def _modules(folder: str):
    for path, _, files in os.walk(os.path.join(ROOT, folder)):
        for name in files:
            if name.endswith(".py"):
                yield os.path.join(path, name)


def _imports(path: str) -> list[tuple[int, str]]:
    """(line, module) of every import statement in the file, at any depth."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
    return found


def _relative(path: str) -> str:
    return os.path.relpath(path, ROOT)


def test_parallel_never_imports_engine():
    upward = [
        f"{_relative(path)}:{line} imports {module}"
        for path in _modules("parallel")
        for line, module in _imports(path)
        if module == "engine" or module.startswith("engine.")
    ]
    assert upward == []


def test_config_imports_nothing_above_it():
    upward = [
        f"{_relative(path)}:{line} imports {module}"
        for path in _modules(os.path.join("engine", "config"))
        for line, module in _imports(path)
        if module.startswith("engine.") and not module.startswith(CONFIG_MAY_IMPORT)
    ]
    assert upward == []


def test_engine_root_holds_only_entry_points_and_errors():
    root = os.path.join(ROOT, "engine")
    modules = {n for n in os.listdir(root) if n.endswith(".py")}
    assert modules <= ENGINE_ROOT_MODULES, sorted(modules - ENGINE_ROOT_MODULES)


def test_no_module_is_over_500_lines():
    long = []
    for folder in ("engine", "parallel", "tools"):
        for path in _modules(folder):
            with open(path, encoding="utf-8") as f:
                count = sum(1 for _ in f)
            if count > 500:
                long.append(f"{_relative(path)}: {count} lines")
    assert long == []
