"""The tools' entry-point wrapper: see engine/cli.py (one-line errors, exit code 2)."""

from engine.cli import run_main as run

__all__ = ["run"]
