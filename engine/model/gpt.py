"""The GPT / Llama-style decoder, or the part of it one pipeline stage holds.

GPTModel(pre_process, post_process, layer_numbers) holds the embedding only on the first
stage (pre_process), the final norm, output layer and loss only on the last (post_process), and
the transformer layers whose global numbers it is given. Layers are kept under their global
numbers ("layers.7...."), so parameter names, initialisation seeds and checkpoints do not
depend on how the model is cut. Activations between layers are [s, b, h] ([s/tp, b, h] under
sequence parallelism); under context parallelism s is this rank's two chunks of the sequence
(tokens and labels come in split, see engine/train/step.py) and positions are global ones.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config.model import ModelConfig
from engine.model.context import BuildContext
from engine.model.document_attention import Documents
from engine.model.layer import TransformerLayer
from engine.model.multi_token import MultiTokenPrediction
from engine.model.rope import RotaryEmbedding
from parallel.random import checkpoint
from parallel.tensor_parallel.init import draw_full
from parallel.tensor_parallel.layers import (
    gather_logits,
)
from parallel.tensor_parallel.regions import scatter_to_sequence_parallel_region
from parallel.tensor_parallel.sharding import mark_tp_partial_grad

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"


class Embedding(nn.Module):
    """Vocab-parallel word embedding, plus learned absolute positions for GPT-2 style."""

    def __init__(self, ctx: BuildContext, tp_rank: int):
        super().__init__()
        cfg = ctx.config
        self.ctx, self.tp_rank = ctx, tp_rank
        self.word_embeddings = ctx.vocab_embedding(WORD_EMBEDDINGS)
        # --decoupled-lr trains the word embeddings and the output layer at its own rate
        self.word_embeddings.weight.is_embedding_or_output_parameter = True
        if cfg.position_embedding_type == "learned_absolute":
            weight = draw_full(
                (cfg.max_positions, cfg.hidden_size),
                ctx.init_method,
                ctx.param_seed("embedding.position_embeddings.weight"),
                ctx.device,
            )
            self.position_embeddings = nn.Embedding(
                cfg.max_positions, cfg.hidden_size, _weight=weight.to(ctx.device, ctx.params_dtype)
            )
            if ctx.sequence_parallel:
                mark_tp_partial_grad(self.position_embeddings.weight)
        else:
            self.position_embeddings = None

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None):
        """tokens [b, s] -> [s(/tp), b, h]; position_ids [b, s]: each sample's own positions
        (--reset-position-ids), by default the tokens' places in the sequence."""
        x = self.word_embeddings(tokens.t())  # [s(/tp), b, h]
        if self.position_embeddings is not None:
            s = x.shape[0]
            start = self.tp_rank * s if self.ctx.sequence_parallel else 0
            if position_ids is not None:
                table = self.position_embeddings(position_ids.t()[start : start + s])
                x = x + table  # [s(/tp), b, h]
            else:
                positions = self.ctx.token_positions(tokens.shape[1], x.device)
                x = x + self.position_embeddings(positions[start : start + s]).unsqueeze(1)
        return self.ctx.hidden_dropout(x, self.training)


class GPTModel(nn.Module):
    """Decoder-only language model (or one pipeline stage of it).

    forward(tokens=[b, s] on the first stage, or hidden=[s(/tp), b, h] from the previous
    stage; labels=[b, s] on the last stage) returns the per-token loss [b, s] (fp32) when
    labels are given on the last stage (with --z-loss-coeff, a pair: the loss and the z-loss
    term), the TP-local logits [s, b, V/tp] without labels, and the hidden states on other
    stages.
    """

    def __init__(
        self,
        config: ModelConfig,
        ctx: BuildContext,
        *,
        tp_rank: int = 0,
        pre_process: bool = True,
        post_process: bool = True,
        layer_numbers: list[int] | range | None = None,
    ):
        super().__init__()
        if ctx.config is not config:
            raise ValueError("ctx.config must be the model's config")
        config.validate(ctx.tp_size, ctx.sequence_parallel)
        self.config, self.ctx = config, ctx
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_numbers = list(
            range(config.num_layers) if layer_numbers is None else layer_numbers
        )
        self.tied = not config.untie_embeddings_and_output_weights
        # the word embeddings are also the last stage's where it predicts from them
        # (tied) or embeds with them (multi-token prediction)
        self.shares_embedding = self.tied or config.mtp_depths > 0
        self.embedding = Embedding(ctx, tp_rank) if pre_process else None
        self.rotary = RotaryEmbedding.for_config(config, ctx.device) if config.uses_rope else None
        self._rotary_tables: tuple | None = None  # ((length, device), tables) of the last call
        self.layers = nn.ModuleDict({str(n): TransformerLayer(ctx, n) for n in self.layer_numbers})
        self.final_layernorm = self.output_layer = self.word_embeddings_for_head = None
        self.mtp = MultiTokenPrediction(ctx) if post_process and config.mtp_depths else None
        if post_process:
            self.final_layernorm = ctx.norm()
            padded = config.padded_vocab_size(ctx.tp_size)
            if not self.tied:
                self.output_layer = ctx.column_linear(
                    "output_layer",
                    config.hidden_size,
                    padded,
                    bias=False,
                    initialized_rows=config.vocab_size,
                )
                self.output_layer.weight.is_embedding_or_output_parameter = True
            if self.shares_embedding and not pre_process:
                # The last stage keeps its own copy of the embedding, drawn from the same
                # seed; the pipeline keeps the copies equal by all-reducing their gradients.
                self.word_embeddings_for_head = ctx.vocab_embedding(WORD_EMBEDDINGS, scatter=False)
                weight = self.word_embeddings_for_head.weight
                weight.shared_embedding = True  # a duplicate: not counted in the grad norm
                weight.is_embedding_or_output_parameter = True
                weight.checkpoint_name = WORD_EMBEDDINGS
        shared = self.shared_embedding_weight()
        if shared is not None and not (pre_process and post_process):
            # Its gradient is summed with the other stage's copy before the DP reduction.
            shared.pipeline_shared = True

    # --- pieces ------------------------------------------------------------------------

    def shared_embedding_weight(self) -> nn.Parameter | None:
        """The word-embedding weight this stage holds (first or last stage) when the last
        stage shares it (tied, or multi-token prediction), if any."""
        if not self.shares_embedding:
            return None
        if self.embedding is not None:
            return self.embedding.word_embeddings.weight
        if self.word_embeddings_for_head is not None:
            return self.word_embeddings_for_head.weight
        return None

    def sharding_units(self) -> list[nn.Module]:
        """The modules whose parameters are gathered together with sharded parameters
        (parallel/data_parallel/fsdp_params.py), in forward order. The word embeddings are a unit of
        their own inside the embedding's: a tied output layer calls them directly."""
        units = []
        if self.embedding is not None:
            units += [self.embedding, self.embedding.word_embeddings]
        units += list(self.layers.values())
        units += [self.final_layernorm, self.output_layer, self.word_embeddings_for_head]
        units += list(self.mtp.layers) if self.mtp is not None else []
        return [unit for unit in units if unit is not None]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.output_layer is not None:
            return self.output_layer(x)
        # Tied: the embedding table projects (its gradient stays with autograd, no fusion into
        # main_grad: the table has two uses on one stage; see
        # parallel/tensor_parallel/linear_function.py).
        head = self.word_embeddings_for_head
        if head is None:
            head = self.embedding.word_embeddings
        return head(x, tied_output="gather" if self.ctx.sequence_parallel else "copy")

    def _embed_ahead(self, ids: torch.Tensor) -> torch.Tensor:
        """Multi-token prediction's embedding of tokens ids [b, s]: [s(/tp), b, h], as the
        first stage embeds (the last stage's copy of the weights where it is another)."""
        if self.embedding is not None:
            return self.embedding(ids)
        ctx = self.ctx
        x = self.word_embeddings_for_head(ids.t())  # [s, b, h], whole
        if ctx.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, ctx.tp_group, ctx.times)
        return ctx.hidden_dropout(x, self.training)

    def _token_losses(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The output layer's cross entropy of labels [b, s] from hidden states: [b, s]."""
        logits = self._logits(hidden)
        ctx = self.ctx
        loss = ctx.ops.cross_entropy(
            logits, labels.t(), ctx.tp_group, self.config.vocab_size, times=ctx.times
        )
        return loss.t()

    def _rotary(self, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin tables of this rank's positions of a length-seq chunk, made once per
        length and device and reused by every micro-batch (they depend on nothing else)."""
        key = (seq, device)
        if self._rotary_tables is None or self._rotary_tables[0] != key:
            positions = self.ctx.token_positions(seq, device)
            self._rotary_tables = (key, self.rotary(positions, seq * self.ctx.cp_size))
        return self._rotary_tables[1]

    def _run_layers(self, x: torch.Tensor, rotary, documents) -> torch.Tensor:
        cfg = self.config
        layers = list(self.layers.values())
        full = cfg.recompute_granularity == "full" and self.training
        if full and cfg.recompute_method == "uniform":
            chunk = cfg.recompute_num_layers
            for start in range(0, len(layers), chunk):
                group = layers[start : start + chunk]
                x = checkpoint(_run_group(group), self.ctx.tracker, x, documents, *(rotary or ()))
            return x
        for index, layer in enumerate(layers):
            if full and index < cfg.recompute_num_layers:  # block: the first N of this stage
                x = checkpoint(_run_group([layer]), self.ctx.tracker, x, documents, *(rotary or ()))
            else:
                x = layer(x, rotary, documents)
        return x

    def forward(
        self,
        tokens: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        mtp_targets: dict | None = None,
    ) -> torch.Tensor:
        """position_ids [b, s(/cp)]: each sample's positions, this rank's part of them
        (--reset-position-ids); document_ids [b, s]: each token's document in its sample, the
        whole sequence's (--reset-attention-mask; engine/data/documents.py makes both);
        mtp_targets: multi-token prediction's (engine/data/multi_token.py), with which the
        last stage returns (token losses, z-loss term or None, the depths' losses)."""
        if self.pre_process:
            x = self.embedding(tokens, position_ids)
        else:
            if hidden is None:
                raise ValueError("a stage without the embedding needs the previous stage's hidden")
            x = hidden
        rotary = None
        if self.rotary is not None and position_ids is not None:
            rotary = self.rotary(position_ids, position_ids.shape[1] * self.ctx.cp_size)
        elif self.rotary is not None:
            rotary = self._rotary(
                x.shape[0] * (self.ctx.tp_size if self.ctx.sequence_parallel else 1), x.device
            )
        documents = Documents(document_ids) if document_ids is not None else None
        x = self._run_layers(x, rotary, documents)
        if not self.post_process:
            return x
        normed = self.final_layernorm(x)
        logits = self._logits(normed)  # [s, b, V/tp]
        if labels is None:
            return logits
        coeff = self.config.z_loss_coeff
        loss, lse = self.ctx.ops.cross_entropy(
            logits,
            labels.t(),
            self.ctx.tp_group,
            self.config.vocab_size,
            return_logsumexp=True,
            times=self.ctx.times,
        )
        z_term = (coeff * lse.square()).t() if coeff > 0.0 else None
        if self.mtp is not None and mtp_targets is not None:
            token_losses, depths = self.mtp(
                loss.t(), normed, mtp_targets, rotary, documents, self._embed_ahead,
                self._token_losses,
            )  # fmt: skip
            return token_losses, z_term, depths
        return loss.t() if z_term is None else (loss.t(), z_term)  # [b, s]

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[b, s, V] logits over the real vocabulary, gathered over TP (inference, tests)."""
        return gather_logits(logits, self.ctx.tp_group, self.config.vocab_size).transpose(0, 1)


def _run_group(layers: list[TransformerLayer]):
    def run(x: torch.Tensor, documents, *rotary: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            x = layer(x, rotary or None, documents)
        return x

    return run


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Parameters this rank holds: 'local' = 'tp_split' (its share of TP-split tensors) +
    'replicated' (norms, biases after row-parallel, positions: whole on every TP rank)."""
    from parallel.tensor_parallel.sharding import tp_sharding_of

    split = replicated = 0
    for param in model.parameters():
        if tp_sharding_of(param).replicated:
            replicated += param.numel()
        else:
            split += param.numel()
    return {"local": split + replicated, "tp_split": split, "replicated": replicated}
