"""`outside_compiled_graphs`: what `torch.compiler.disable` does to a function (under
torch.compile it runs eagerly, a graph break around it), without importing torch.compile's
modules when the decorated module is imported. Those take about a second of CPU, which every
engine process paid at start although few compile; here they are imported on the function's
first call (torch's own lazy form of the decorator, where this torch has it)."""

from __future__ import annotations

import torch


def outside_compiled_graphs(fn):
    lazy = getattr(torch, "_disable_dynamo", None)
    return lazy(fn) if lazy is not None else torch.compiler.disable(fn)
