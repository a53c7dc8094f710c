"""Which attention kernel a layer runs, chosen once when the model is built, and the kernels.

- "sdpa-causal": torch's scaled_dot_product_attention with is_causal (cuDNN or flash on GPUs
  in bf16/fp16, memory-efficient in fp32 with as many key/value heads as query heads).
- "sdpa-expanded": the same with keys and values repeated to every query head first: fp32
  grouped-query attention on CUDA, where SDPA's grouped path falls back to the math kernel
  (measured, docs/gpu.md) and materialises the scores; the copies cost heads/groups x K/V.
- "flex-window": a sliding window on CUDA without attention dropout: FlexAttention
  (torch.nn.attention.flex_attention, compiled) with a block mask that skips the blocks
  outside the window, so the work grows with the window, not the sequence.
- "sdpa-mask": a sliding window elsewhere (CPU, or with attention dropout, which FlexAttention
  has not): SDPA with a boolean mask made once per sequence length.
- "flex-documents" and "sdpa-documents": with --reset-attention-mask, a micro-batch whose
  document ids are given attends within documents (engine/model/document_attention.py):
  FlexAttention's block mask on CUDA without dropout, one SDPA call per document elsewhere.
  Without document ids (generation, a single document) the layer's kernel above runs.
- "sinks": with --softmax-type off-by-one or learnable, a logit per head beside the scores
  (engine/model/attention_sinks.py: the block kernels that return the log-sum-exp, or the
  tiled fp32 path with a window).

Masks and the compiled FlexAttention are made once per model (`AttentionMasks`, held by the
BuildContext), not per layer. `describe(kinds, layers)` is the start-up line naming each
layer's kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.attention_sinks import sink_attention
from engine.model.document_attention import attend_by_document
from engine.ops.outside_graphs import outside_compiled_graphs

KINDS = ("sdpa-causal", "sdpa-expanded", "flex-window", "sdpa-mask", "sinks")
DOCUMENT_KINDS = ("flex-documents", "sdpa-documents")


def choose_kernel(
    device: torch.device,
    dtype: torch.dtype,
    grouped: bool,
    window: int | None,
    dropout: float,
    sinks: bool = False,
) -> str:
    if sinks:
        return "sinks"
    cuda = torch.device(device).type == "cuda"
    if window is not None:
        return "flex-window" if cuda and dropout == 0.0 else "sdpa-mask"
    if grouped and cuda and dtype == torch.float32:
        return "sdpa-expanded"
    return "sdpa-causal"


def choose_document_kernel(device: torch.device, dropout: float) -> str:
    """The kernel of attention within documents (--reset-attention-mask)."""
    cuda = torch.device(device).type == "cuda"
    return "flex-documents" if cuda and dropout == 0.0 else "sdpa-documents"


def describe(kinds: list[str], layers: list[int]) -> str:
    """'layers 0-11: sdpa-causal; 12-23: flex-window' from each layer's kernel (layers in
    order; a pipeline rank holds some)."""
    runs: list[list] = []
    for layer, kind in zip(layers, kinds, strict=False):
        if runs and runs[-1][2] == kind and runs[-1][1] == layer - 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer, kind])
    parts = [f"{a}-{b}: {kind}" if a != b else f"{a}: {kind}" for a, b, kind in runs]
    return "layers " + "; ".join(parts)


def window_mask(seq: int, window: int, device) -> torch.Tensor:
    """Causal and at most `window` tokens back (Hugging Face's sliding-window mask)."""
    positions = torch.arange(seq, device=device)
    back = positions[:, None] - positions[None, :]
    return (back >= 0) & (back <= window)


def window_block_mask(seq: int, window: int, device):
    """FlexAttention's block mask of the same window."""
    from torch.nn.attention.flex_attention import create_block_mask

    def inside(batch, head, query, key):
        return (query >= key) & (query - key <= window)

    return create_block_mask(inside, None, None, seq, seq, device=str(device))


class AttentionMasks:
    """Masks and the compiled FlexAttention, shared by all layers of a model (BuildContext
    holds one): each mask is made once per (kind, length, window, device)."""

    def __init__(self):
        self.masks: dict = {}
        self.flex = None

    def mask(self, kind: str, seq: int, window: int, device):
        key = (kind, seq, window, str(device))
        if key not in self.masks:
            make = window_block_mask if kind == "flex-window" else window_mask
            self.masks[key] = make(seq, window, device)
        return self.masks[key]

    def flex_attention(self, cuda: bool):
        if self.flex is None:
            from torch.nn.attention.flex_attention import flex_attention

            self.flex = torch.compile(flex_attention) if cuda else flex_attention
        return self.flex


class AttentionKernel:
    """One layer's attention over whole sequences [b, heads, s, d] (the kinds chosen above:
    `document_kind` runs when the call is given the micro-batch's Documents)."""

    def __init__(
        self,
        kind: str,
        window: int | None,
        grouped: bool,
        masks: AttentionMasks,
        document_kind: str | None = None,
    ):
        if kind not in KINDS:
            raise ValueError(f"attention kernel {kind!r} is not one of {', '.join(KINDS)}")
        if document_kind is not None and document_kind not in DOCUMENT_KINDS:
            raise ValueError(f"attention kernel {document_kind!r} is not one of {DOCUMENT_KINDS}")
        self.kind, self.window, self.grouped, self.masks = kind, window, grouped, masks
        self.document_kind = document_kind

    def __call__(self, q, k, v, dropout: float, documents=None, sink=None) -> torch.Tensor:
        if self.kind == "sinks" and documents is not None:
            return _sinks_by_document(q, k, v, sink, self.window, documents)
        if self.kind == "sinks":
            return sink_attention(q, k, v, sink, self.window)
        if documents is not None and self.document_kind is not None:
            return self._within_documents(q, k, v, dropout, documents)
        if self.kind == "flex-window":
            mask = self.masks.mask(self.kind, q.shape[-2], self.window, q.device)
            flex = self.masks.flex_attention(q.is_cuda)
            return flex(q, k, v, block_mask=mask, enable_gqa=self.grouped)
        kwargs = {}
        if self.kind == "sdpa-expanded":
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        elif self.grouped:
            kwargs["enable_gqa"] = True
        if self.kind == "sdpa-mask":
            kwargs["attn_mask"] = self.masks.mask(self.kind, q.shape[-2], self.window, q.device)
        else:
            kwargs["is_causal"] = True
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, **kwargs)

    # Outside --torch-compile's graphs: every micro-batch has documents of its own, which a
    # compiled layer would otherwise be recompiled for (tests/test_torch_compile.py).
    @outside_compiled_graphs
    def _within_documents(self, q, k, v, dropout: float, documents) -> torch.Tensor:
        if self.document_kind == "flex-documents":
            flex = self.masks.flex_attention(q.is_cuda)
            mask = documents.block_mask(self.window)
            return flex(q, k, v, block_mask=mask, enable_gqa=self.grouped)
        return attend_by_document(q, k, v, documents, self.window, dropout, self.grouped)


@outside_compiled_graphs
def _sinks_by_document(q, k, v, sink, window, documents) -> torch.Tensor:
    """Attention with sinks within documents: one document at a time (each row's sink beside
    its own document's scores), as the CPU's per-document path runs."""
    rows = []
    for sample, spans in enumerate(documents.spans()):
        parts = [
            sink_attention(*(t[sample : sample + 1, :, a:b] for t in (q, k, v)), sink, window)
            for a, b in spans
        ]
        rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
    return torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]
