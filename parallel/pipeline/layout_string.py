"""Megatron-LM's --pipeline-model-parallel-layout, read: which layers each pipeline stage
(and virtual stage) holds, written as a string.

`E` is the embedding, `t` a transformer (decoder) layer, `m` a multi-token-prediction layer,
`L` the loss (final norm, output layer); `|` ends a stage; `X*N` repeats one character and
`(...)*N` a group (not nested), so "Et*2|(tt|)*5t|tmL" is eight stages; commas are cosmetic.
Stage i of the string is virtual stage i // PP of pipeline rank i % PP. Megatron-LM's rules:
the stages divide by PP, E comes first and L last (once each), there are --num-layers t and
--mtp-num-layers m, all after the last t, in one stage. This engine also asks what its
runtime needs: E in the first stage, L in the last, the m beside the L (megatron-core's
"standalone" MTP stage is not built here).

`counts` of the result are the decoder layers of each stage in string order; layers are
numbered in that order, as megatron-core numbers them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from parallel.errors import ConfigError

FLAG = "--pipeline-model-parallel-layout"
KINDS = "EtmL"


@dataclass(frozen=True)
class PipelineLayout:
    stages: tuple[str, ...]  # each stage's characters, in string order

    @property
    def counts(self) -> tuple[int, ...]:
        """Decoder layers of each stage."""
        return tuple(stage.count("t") for stage in self.stages)

    def virtual_size(self, pp: int) -> int:
        return len(self.stages) // pp


def unrolled(text: str) -> str:
    """The string with its cosmetic commas dropped and its repetitions written out."""
    text = text.replace(",", "").replace(" ", "")
    text = re.sub(r"\(([^()]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    return re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)


def parse_layout(text: str, pp: int, num_layers: int, mtp_layers: int = 0) -> PipelineLayout:
    """The layout `text` describes, checked (module docstring); ConfigError in one line
    naming the flag, the problem and the fix."""
    flat = unrolled(text)
    wrong = sorted(set(flat) - set(KINDS + "|"))
    if wrong:
        raise ConfigError(
            f"{FLAG} {text}: {wrong[0]!r} is not a layer; use E (embedding), t (transformer "
            "layer), m (MTP layer), L (loss), | between stages, X*N and (...)*N to repeat"
        )
    stages = tuple(flat.split("|"))
    if len(stages) % pp:
        raise ConfigError(
            f"{FLAG} {text}: {len(stages)} stages do not divide among "
            f"--pipeline-model-parallel-size {pp}; give a multiple of {pp} stages"
        )
    layers = "".join(stages)
    counts = {kind: layers.count(kind) for kind in KINDS}
    expected = {"E": 1, "L": 1, "t": num_layers, "m": mtp_layers}
    flags = {"E": "one embedding", "L": "one loss", "t": f"--num-layers {num_layers}",
             "m": f"--mtp-num-layers {mtp_layers}"}  # fmt: skip
    for kind in "EtmL":
        if counts[kind] != expected[kind]:
            raise ConfigError(
                f"{FLAG} {text}: {counts[kind]} {kind!r}, but the model has {flags[kind]}; "
                "give exactly that many"
            )
    if not layers.startswith("E") or not layers.endswith("L"):
        raise ConfigError(f"{FLAG} {text}: the layers must begin with E and end with L")
    if "E" not in stages[0] or "L" not in stages[-1]:
        raise ConfigError(
            f"{FLAG} {text}: E must be in the first stage and L in the last (no empty stage "
            "before the embedding or after the loss)"
        )
    if mtp_layers:
        if layers.rindex("t") > layers.index("m"):
            raise ConfigError(f"{FLAG} {text}: the MTP layers (m) come after every t")
        if stages[-1].count("m") != mtp_layers:
            raise ConfigError(
                f"{FLAG} {text}: put every m in the last stage, beside the L (an MTP stage of "
                "its own, megatron-core's standalone MTP, is not built here)"
            )
    return PipelineLayout(stages)


def split_counts(
    num_layers: int, pp: int, vpp: int, embedding: bool, loss: bool
) -> tuple[int, ...]:
    """--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split: the
    embedding and the loss each take a layer's place in the even split (the first stage's
    first chunk and the last stage's last chunk hold one decoder layer fewer), as
    Megatron-LM reads them; decoder layers per stage in layout order."""
    total = num_layers + embedding + loss
    chunks = pp * vpp
    if total % chunks:
        flags = " and ".join(
            f"--account-for-{name}-in-pipeline-split" for name, on in
            (("embedding", embedding), ("loss", loss)) if on
        )  # fmt: skip
        raise ConfigError(
            f"{flags}: --num-layers {num_layers} + {embedding + loss} = {total} does not "
            f"divide into {chunks} pipeline chunks (PP x virtual stages); change --num-layers"
        )
    counts = [total // chunks] * chunks
    counts[0] -= embedding
    counts[-1] -= loss
    if min(counts) < 0:
        raise ConfigError("a pipeline chunk is left with fewer than no decoder layers")
    return tuple(counts)
