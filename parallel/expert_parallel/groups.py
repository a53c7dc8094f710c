"""The expert process groups of a layout, megatron-core's "parallel folding": within each
pipeline stage the ranks of TP x CP x DP are numbered again as ETP x EP x EDP (expert tensor
parallel, expert parallel, expert data parallel), ETP innermost, in the same order of the
rest as the dense groups (EDP before PP, or after it with --use-tp-pp-dp-mapping):

    rank = ((pp_rank * edp + edp_rank) * ep + ep_rank) * etp + etp_rank
    rank = ((edp_rank * pp + pp_rank) * ep + ep_rank) * etp + etp_rank   (pp_inside_dp)

so EDP = TP x CP x DP / (ETP x EP). An EP group holds the experts of an MoE layer between
them; an EDP group holds the same experts (their gradients are reduced over it).
"""

from __future__ import annotations

import itertools

from parallel.errors import ConfigError


def expert_data_parallel_size(tp: int, cp: int, dp: int, ep: int, etp: int) -> int:
    """EDP of a layout, or ConfigError naming the flags when ETP x EP does not divide a
    pipeline stage's TP x CP x DP ranks."""
    if ep < 1 or etp < 1:
        raise ConfigError("--expert-model-parallel-size and --expert-tensor-parallel-size >= 1")
    stage = tp * cp * dp
    if stage % (ep * etp):
        raise ConfigError(
            f"expert-tensor-parallel-size {etp} x expert-model-parallel-size {ep} does not "
            f"divide the {stage} ranks of a pipeline stage (tensor x context x data parallel)"
        )
    return stage // (ep * etp)


def expert_layout_groups(
    tp: int, cp: int, dp: int, pp: int, ep: int, etp: int, pp_inside_dp: bool = False
) -> dict[str, list[list[int]]]:
    """The global ranks of every expert group, by kind: "ep", "expert_dp", "expert_tp",
    "expert_tp_ep" (ETP x EP) and "expert_tp_ep_pp" (ETP x EP x PP: the ranks holding
    different experts, over which their gradient norm is summed), each list in the order the
    groups are created."""
    edp = expert_data_parallel_size(tp, cp, dp, ep, etp)
    if pp_inside_dp and pp > 1 and edp != dp:
        raise ConfigError(
            "--use-tp-pp-dp-mapping with pipeline parallelism needs the experts' data-parallel "
            f"size ({edp}) to equal the data-parallel size ({dp}), as in Megatron-LM"
        )

    def rank_of(p: int, x: int, e: int, t: int) -> int:
        outer = x * pp + p if pp_inside_dp else p * edp + x
        return (outer * ep + e) * etp + t

    def every(*sizes):
        return itertools.product(*(range(n) for n in sizes))

    return {
        "ep": [[rank_of(p, x, e, t) for e in range(ep)] for p, x, t in every(pp, edp, etp)],
        "expert_dp": [[rank_of(p, x, e, t) for x in range(edp)] for p, e, t in every(pp, ep, etp)],
        "expert_tp": [[rank_of(p, x, e, t) for t in range(etp)] for p, x, e in every(pp, edp, ep)],
        "expert_tp_ep": [
            [rank_of(p, x, e, t) for e in range(ep) for t in range(etp)] for p, x in every(pp, edp)
        ],
        "expert_tp_ep_pp": [
            [rank_of(p, x, e, t) for p in range(pp) for e in range(ep) for t in range(etp)]
            for x in range(edp)
        ],
    }
