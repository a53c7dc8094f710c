"""The decoder model: GPTModel and its layers."""

from engine.model.context import BuildContext
from engine.model.gpt import GPTModel, parameter_counts

__all__ = ["BuildContext", "GPTModel", "parameter_counts"]
