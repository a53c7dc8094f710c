"""Conversion between our checkpoints and Hugging Face transformers folders."""
