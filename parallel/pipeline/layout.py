"""Which decoder layers each pipeline stage (and virtual stage) holds."""

from __future__ import annotations

from parallel.errors import ConfigError


def stage_layers(
    num_layers: int,
    pp_size: int,
    pp_rank: int,
    virtual_size: int = 1,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> list[list[int]]:
    """Global layer numbers of each model chunk on this pipeline rank.

    Layers are cut into pp_size * virtual_size consecutive chunks; chunk c of rank r is
    global chunk c * pp_size + r (interleaved order). --decoder-first/last-pipeline-num-layers
    give the first and last stage a different count (only without virtual stages); the rest
    is split evenly.
    """
    if pp_size == 1 and virtual_size == 1:
        return [list(range(num_layers))]
    if (first_stage_layers or last_stage_layers) and virtual_size > 1:
        raise ConfigError(
            "--decoder-first/last-pipeline-num-layers cannot be combined with "
            "--num-layers-per-virtual-pipeline-stage"
        )
    counts = _stage_counts(num_layers, pp_size, virtual_size, first_stage_layers, last_stage_layers)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [
        list(
            range(
                starts[c * pp_size + pp_rank],
                starts[c * pp_size + pp_rank] + counts[c * pp_size + pp_rank],
            )
        )
        for c in range(virtual_size)
    ]


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
