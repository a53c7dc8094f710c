"""Which decoder layers each pipeline stage (and virtual stage) holds."""

from __future__ import annotations

from parallel.errors import ConfigError

PLACEMENTS = ("loop", "v")


def virtual_stage(placement: str, pp_size: int, pp_rank: int, chunk: int) -> int:
    """Where chunk `chunk` of rank `pp_rank` sits in the model: "loop" (Megatron-LM's
    interleaving) puts it at chunk * pp_size + pp_rank; "v" (two chunks, zero-bubble ZB-V)
    puts chunk 0 at pp_rank and chunk 1 at 2 pp_size - 1 - pp_rank."""
    if placement == "v":
        return pp_rank if chunk == 0 else 2 * pp_size - 1 - pp_rank
    return chunk * pp_size + pp_rank


def stage_layers(
    num_layers: int,
    pp_size: int,
    pp_rank: int,
    virtual_size: int = 1,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    placement: str = "loop",
    counts: tuple[int, ...] | None = None,
) -> list[list[int]]:
    """Global layer numbers of each model chunk on this pipeline rank.

    Layers are cut into pp_size * virtual_size consecutive chunks; chunk c of rank r is
    global chunk `virtual_stage(placement, ...)`. --decoder-first/last-pipeline-num-layers
    give the first and last stage a different count (only without virtual stages); the rest
    is split evenly. `counts`: each global chunk's layers as given (a
    --pipeline-model-parallel-layout, parallel/pipeline/layout_string.py).
    """
    if placement == "v" and virtual_size != 2:
        raise ConfigError("the V placement (zb-v) holds exactly 2 model chunks per rank")
    if counts is not None:
        if len(counts) != pp_size * virtual_size or sum(counts) != num_layers:
            raise ConfigError(
                f"{len(counts)} pipeline chunks of {sum(counts)} layers do not make "
                f"{pp_size} x {virtual_size} chunks of --num-layers {num_layers}"
            )
        counts = list(counts)
    elif pp_size == 1 and virtual_size == 1:
        return [list(range(num_layers))]
    elif (first_stage_layers or last_stage_layers) and virtual_size > 1:
        raise ConfigError(
            "--decoder-first/last-pipeline-num-layers cannot be combined with virtual "
            "pipeline stages"
        )
    else:
        counts = _stage_counts(
            num_layers, pp_size, virtual_size, first_stage_layers, last_stage_layers
        )
    starts = [sum(counts[:i]) for i in range(len(counts))]
    stages = [virtual_stage(placement, pp_size, pp_rank, c) for c in range(virtual_size)]
    return [list(range(starts[s], starts[s] + counts[s])) for s in stages]


def _stage_counts(num_layers, pp, vpp, first, last) -> list[int]:
    chunks = pp * vpp
    if first is None and last is None:
        if num_layers % chunks:
            raise ConfigError(
                f"num-layers {num_layers} is not divisible by pipeline-model-parallel-size {pp}"
                + (f" x virtual stages {vpp}" if vpp > 1 else "")
                + "; change --num-layers or set --decoder-first/last-pipeline-num-layers"
            )
        return [num_layers // chunks] * chunks
    middle_stages = pp - (first is not None) - (last is not None)
    remaining = num_layers - (first or 0) - (last or 0)
    if (
        remaining < 0
        or (middle_stages == 0 and remaining)
        or (middle_stages and remaining % middle_stages)
    ):
        raise ConfigError(
            f"with --decoder-first-pipeline-num-layers {first} and "
            f"--decoder-last-pipeline-num-layers {last}, the other {num_layers} - those layers "
            f"do not split evenly over the {middle_stages} middle stages"
        )
    middle = remaining // middle_stages if middle_stages else 0
    counts = [middle] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    if min(counts) < 0:
        raise ConfigError("every pipeline stage needs a non-negative number of layers")
    return counts
