"""The documents inside a packed sample, found from its end-of-document (EOD) tokens, and what
Megatron-LM's --reset-position-ids, --reset-attention-mask and --eod-mask-loss make of them.

A sample packs `seq_length + 1` tokens across document boundaries. An EOD token ends the
document it belongs to; the next token starts a new one. With --reset-attention-mask a token
attends only to earlier tokens of its own document (`document_ids` equal), with
--reset-position-ids positions count from 0 again at each document's first token, and with
--eod-mask-loss the prediction made at an EOD token (of the next document's first token)
carries no loss: megatron-core's GPTDataset computes the same three from the same input tokens
(tests/test_documents.py compares them sample by sample). Computed without [s, s] masks:
`allowed_attention` builds one only as the explicit reference for tests.

A run's `Packing` (the three flags and the tokenizer's EOD) adds them to every micro-batch on
its device (engine/train/batches.py): `position_ids` (RoPE and learned positions),
`document_ids` (attention within documents: engine/model/document_attention.py; under context
parallelism the whole sequence's, parallel/context_parallel/) and `loss_mask`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DocumentLayout:
    """Per input token [..., s]: its document's index in the sample (0 for every token unless
    --reset-attention-mask), its position, and the weight of its prediction's loss."""

    document_ids: torch.Tensor  # int64
    position_ids: torch.Tensor  # int64
    loss_mask: torch.Tensor  # float32, 1 or 0

    def allowed_attention(self) -> torch.Tensor:
        """[..., s, s] bool: query i may attend to key j (j <= i, the same document)."""
        s = self.document_ids.shape[-1]
        causal = torch.ones(s, s, dtype=torch.bool, device=self.document_ids.device).tril()
        same = self.document_ids[..., :, None] == self.document_ids[..., None, :]
        return causal & same


def document_layout(
    tokens: torch.Tensor,
    eod: int,
    *,
    reset_position_ids: bool = False,
    reset_attention_mask: bool = False,
    eod_mask_loss: bool = False,
) -> DocumentLayout:
    """The layout of input tokens [..., s] (a sample's first s tokens) under the three flags."""
    is_eod = tokens == eod
    index = torch.arange(tokens.shape[-1], device=tokens.device).expand_as(tokens)
    # EODs strictly before each token: the index of its document (an EOD ends its own)
    before = torch.cumsum(is_eod.long(), dim=-1) - is_eod.long()
    document_ids = before if reset_attention_mask else torch.zeros_like(before)
    position_ids = index.clone()
    if reset_position_ids:
        # each token's document starts one past the last EOD before it (0 without one)
        next_start = torch.where(is_eod, index + 1, torch.zeros_like(index))
        reached = torch.cummax(next_start, dim=-1).values
        start = torch.cat([torch.zeros_like(reached[..., :1]), reached[..., :-1]], dim=-1)
        position_ids = index - start
    loss_mask = torch.ones(tokens.shape, dtype=torch.float32, device=tokens.device)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    return DocumentLayout(document_ids, position_ids, loss_mask)


@dataclass(frozen=True)
class Packing:
    """What a run makes of the end-of-document token `eod` in its samples (Megatron-LM's
    --reset-position-ids, --reset-attention-mask, --eod-mask-loss)."""

    eod: int
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    @property
    def every_stage(self) -> bool:
        """Whether every pipeline stage needs the batch (positions or documents for its
        layers), not only the first and last."""
        return self.reset_position_ids or self.reset_attention_mask

    def annotate(self, batch: dict) -> dict:
        """The micro-batch with `position_ids`, `document_ids` and `loss_mask` [b, s] added
        where the flags ask for them (a mask already there is multiplied in)."""
        layout = document_layout(
            batch["tokens"],
            self.eod,
            reset_position_ids=self.reset_position_ids,
            reset_attention_mask=self.reset_attention_mask,
            eod_mask_loss=self.eod_mask_loss,
        )
        out = dict(batch)
        if self.reset_position_ids:
            out["position_ids"] = layout.position_ids
        if self.reset_attention_mask:
            out["document_ids"] = layout.document_ids
        if self.eod_mask_loss:
            kept = batch.get("loss_mask")
            out["loss_mask"] = layout.loss_mask if kept is None else layout.loss_mask * kept
        return out
