"""What multi-token prediction reads of a micro-batch (engine/model/multi_token.py): for each
depth k = 1..D, every position's token, label and loss-mask value k places ahead (zero past the
end of the sample, where nothing is predicted), as megatron-core rolls them, and how many
positions carry loss at each depth. Made from the whole samples before context parallelism
cuts them, so that a CP rank's positions need nothing from its neighbours."""

from __future__ import annotations

import torch


def _ahead(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [b, s] moved k places to the left along the sequence, zeros entering at the end."""
    out = torch.zeros_like(x)
    if k < x.shape[1]:
        out[:, : x.shape[1] - k] = x[:, k:]
    return out


def multi_token_targets(batch: dict, depths: int) -> dict:
    """`batch` with mtp_tokens, mtp_labels, mtp_mask [b, s, depths] (depth k-1 in the last
    index) and mtp_counts [depths] (the positions that carry loss at each depth)."""
    tokens, labels = batch["tokens"], batch["labels"]
    mask = batch.get("loss_mask")
    mask = torch.ones_like(labels, dtype=torch.float32) if mask is None else mask.float()
    ks = range(1, depths + 1)
    masks = torch.stack([_ahead(mask, k) for k in ks], dim=-1)
    return batch | {
        "mtp_tokens": torch.stack([_ahead(tokens, k) for k in ks], dim=-1),
        "mtp_labels": torch.stack([_ahead(labels, k) for k in ks], dim=-1),
        "mtp_mask": masks,
        "mtp_counts": masks.sum(dim=(0, 1)),
    }
