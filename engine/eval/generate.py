"""Greedy generation with a single-process GPTModel (for checks and demos; no KV cache)."""

from __future__ import annotations

import torch


@torch.no_grad()
def greedy_generate(
    model, prompt: list[int], max_new_tokens: int, eos_id: int | None = None
) -> list[int]:
    """prompt + up to max_new_tokens argmax continuations (stops after eos_id)."""
    model.eval()
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    for _ in range(max_new_tokens):
        logits = model.full_logits(model(tokens=ids))  # [1, s, V]
        next_id = int(logits[0, -1].argmax())
        ids = torch.cat([ids, torch.tensor([[next_id]], device=device)], dim=1)
        if eos_id is not None and next_id == eos_id:
            break
    return ids[0].tolist()
