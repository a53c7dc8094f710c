"""Megatron-LM compatibility: its flags that have no effect here or name a missing feature."""
