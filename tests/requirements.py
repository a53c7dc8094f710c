"""The pinned dependencies the tests compare against (megatron-core, lm-eval, datatrove, wandb,
einops; requirements.txt and the Makefile install them): missing, a test fails naming the fix,
it does not skip, so a broken install cannot pass for a green run."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str) -> ModuleType:
    """The module, imported; AssertionError naming it and the fix when it is not there."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise AssertionError(
            f"pinned test dependency {module} cannot be imported ({err}); run `make venv`"
        ) from None
