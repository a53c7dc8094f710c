"""Our checkpoints as an lm-evaluation-harness model, `tripod` (lm_eval is optional: this
module is imported only by tools/lm_eval_tripod.py and the tests, which have it).

  python tools/lm_eval_tripod.py --model tripod --model_args load=SAVE_DIR[,iteration=N] \\
      --tasks TASK [--include_path DIR_OF_TASK_YAMLS]

The model is loaded as tools/evaluate.py loads it (our checkpoint under any layout, or a Hugging
Face folder) and scored with the same code (engine/eval/): log-likelihoods of continuations
(with whether greedy decoding would produce them), rolling log-likelihoods in windows of the
model's length, and greedy generation until a stop string.
"""

from __future__ import annotations

import lm_eval.models  # noqa: F401 - the harness's own models stay registered beside ours
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from engine.eval.loading import (
    load_model,
    plain_tokenizer,
    recorded_packing,
    score_continuation,
)
from engine.eval.multiple_choice import encode_pair


@register_model("tripod")
class TripodLM(LM):
    """lm_eval's LM interface over one process's GPTModel."""

    def __init__(
        self,
        load: str,
        iteration: int | None = None,
        max_length: int | None = None,
        device: str | None = None,
        batch_size=None,  # lm_eval passes its --batch_size; requests run one at a time here
        max_batch_size=None,
    ):
        super().__init__()
        iteration = int(iteration) if iteration not in (None, "") else None
        self.model, tokenizer, self.shown = load_model(load, iteration)
        self.packing = recorded_packing(load, iteration)  # the run's document flags
        self.place = torch.device(device or "cpu")
        self.model.to(self.place)
        self.tokenizer = plain_tokenizer(tokenizer)
        self.max_length = int(max_length or self.model.config.seq_length)
        bos = getattr(tokenizer, "bos", None)
        self.prefix_id = bos if bos is not None else tokenizer.eod

    def _score(self, context_ids: list[int], continuation_ids: list[int]) -> tuple[float, bool]:
        """Summed log-probability of the continuation, and whether it is the greedy one."""
        return score_continuation(
            self.model, context_ids, continuation_ids, self.max_length, self.prefix_id,
            self.packing,
        )  # fmt: skip

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        out = []
        for request in requests:
            context, continuation = request.args
            context_ids, continuation_ids = encode_pair(self.tokenizer, context, continuation)
            out.append(self._score(context_ids, continuation_ids))
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        out = []
        for request in requests:
            ids = self.tokenizer.tokenize(request.args[0])
            windows = get_rolling_token_windows(ids, self.prefix_id, self.max_length, 1)
            total = 0.0
            for context_ids, continuation_ids in map(make_disjoint_window, windows):
                total += self._score(context_ids, continuation_ids)[0]
            out.append(total)
        return out

    @torch.no_grad()
    def generate_until(self, requests) -> list[str]:
        out = []
        for request in requests:
            context, kwargs = request.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            ids = self.tokenizer.tokenize(context) or [self.prefix_id]
            new: list[int] = []
            for _ in range(int(kwargs.get("max_gen_toks", 256))):
                window = (ids + new)[-self.max_length :]
                tokens = torch.tensor([window], device=self.place)
                logits = self.model.full_logits(self.model(tokens=tokens))
                new.append(int(logits[0, -1].argmax()))
                text = self.tokenizer.detokenize(new)
                if new[-1] == self.tokenizer.eod or any(stop in text for stop in until):
                    break
            text = self.tokenizer.detokenize([t for t in new if t != self.tokenizer.eod])
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out
