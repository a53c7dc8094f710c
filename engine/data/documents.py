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

Not yet used by training: the three flags are refused until attention, positions and the loss
take them (the packed-sequences issue).
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
