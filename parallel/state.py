"""Process groups for tensor (TP), context (CP), data (DP) and pipeline (PP) parallelism.

Global rank layout, TP innermost, then CP, then DP, then PP (Megatron-LM's default order, so
the ranks of a TP group are neighbours and stay inside one node):

    rank = pp_rank * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp + tp_rank

or, with `pp_inside_dp` (Megatron-LM's --use-tp-pp-dp-mapping, order tp-cp-pp-dp), a pipeline's
stages neighbours and DP outermost:

    rank = dp_rank * (pp * cp * tp) + pp_rank * (cp * tp) + cp_rank * tp + tp_rank

The ranks of a CP group hold the same weights and split each sample's sequence; they read the
same batches (so the data loader sees DP ranks only), and gradients are reduced, and the
distributed optimizer shards, over DP x CP together (`dp_cp_group`).

With several distributed-optimizer instances (Megatron-LM's --num-distributed-optimizer-instances
N) each DP x CP group is cut into N blocks of contiguous members: the optimizer shards inside a
block (`dp_cp_shard_group`) and the blocks hold the same shards (`dp_cp_replica_group`: the
members at the same place of each block). `optimizer_instance_group` is one instance: every
rank (all TP, PP) whose DP x CP place lies in its block.

Every group is created by every rank in the same order (torch.distributed requires it). A
`ParallelState` is a plain object passed to whatever needs it: several can live in one process,
and `ParallelState.local()` describes a single process with no groups at all.
"""

from __future__ import annotations

import datetime
import itertools
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from parallel.errors import ConfigError
from parallel.expert_parallel.groups import expert_layout_groups


def check_layout(world_size: int, tp: int, pp: int, dp: int | None = None, cp: int = 1) -> int:
    """Validate tp * cp * pp * dp == world_size and return dp (derived when None)."""
    sizes = (
        ("tensor-model-parallel-size", tp),
        ("pipeline-model-parallel-size", pp),
        ("context-parallel-size", cp),
    )
    for name, value in sizes:
        if value < 1:
            raise ConfigError(f"--{name} {value}: must be at least 1")
    model = tp * cp * pp
    if world_size % model:
        with_cp = f" x context-parallel-size {cp}" if cp > 1 else ""
        raise ConfigError(
            f"world size {world_size} is not divisible by tensor-model-parallel-size {tp}"
            f"{with_cp} x pipeline-model-parallel-size {pp}; launch a multiple of {model} "
            "processes"
        )
    derived = world_size // model
    if dp is not None and dp != derived:
        with_cp = f" x context {cp}" if cp > 1 else ""
        raise ConfigError(
            f"world size {world_size} != tensor {tp}{with_cp} x pipeline {pp} x data {dp}; "
            f"with {world_size} processes the data-parallel size is {derived}"
        )
    return derived


def check_optimizer_instances(instances: int, dp_cp: int) -> int:
    """Validate --num-distributed-optimizer-instances against the DP x CP size; the ranks
    of one instance's DP x CP block."""
    if instances < 1:
        raise ConfigError("--num-distributed-optimizer-instances must be at least 1")
    if dp_cp % instances:
        raise ConfigError(
            f"--num-distributed-optimizer-instances {instances} must divide data-parallel x "
            f"context-parallel size {dp_cp}"
        )
    return dp_cp // instances


def layout_groups(
    tp: int, cp: int, dp: int, pp: int, pp_inside_dp: bool = False, instances: int = 1
) -> dict[str, list[list[int]]]:
    """The global ranks of every group of a layout, by kind: "tp", "cp", "dp", "dp_cp" (DP x
    CP), "pp" (stage by stage) and "model" (TP x PP), each list in the order the groups are
    created; with `instances` > 1 also "dp_cp_shard", "dp_cp_replica" and "instance" (the
    module docstring). Ranks are numbered TP innermost, then CP, then DP, then PP, or PP
    before DP with `pp_inside_dp` (Megatron-LM's orders tp-cp-ep-dp-pp and tp-cp-ep-pp-dp)."""

    def rank_of(p: int, d: int, c: int, t: int) -> int:
        outer = d * pp + p if pp_inside_dp else p * dp + d
        return (outer * cp + c) * tp + t

    def every(*sizes):
        return itertools.product(*(range(n) for n in sizes))

    groups = {
        "tp": [[rank_of(p, d, c, t) for t in range(tp)] for p, d, c in every(pp, dp, cp)],
        "cp": [[rank_of(p, d, c, t) for c in range(cp)] for p, d, t in every(pp, dp, tp)],
        "dp": [[rank_of(p, d, c, t) for d in range(dp)] for p, c, t in every(pp, cp, tp)],
        "dp_cp": [
            [rank_of(p, d, c, t) for d in range(dp) for c in range(cp)] for p, t in every(pp, tp)
        ],
        "pp": [[rank_of(p, d, c, t) for p in range(pp)] for d, c, t in every(dp, cp, tp)],
        "model": [
            [rank_of(p, d, c, t) for p in range(pp) for t in range(tp)] for d, c in every(dp, cp)
        ],
    }
    if instances > 1:
        block = check_optimizer_instances(instances, dp * cp)
        dp_cp = groups["dp_cp"]
        groups["dp_cp_shard"] = [
            g[i * block : (i + 1) * block] for g in dp_cp for i in range(instances)
        ]
        groups["dp_cp_replica"] = [g[j::block] for g in dp_cp for j in range(block)]
        groups["instance"] = [
            sorted(r for g in dp_cp for r in g[i * block : (i + 1) * block])
            for i in range(instances)
        ]
    return groups


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass
class ParallelState:
    """Ranks and process groups of one (tp, cp, dp, pp) layout.

    Groups are None where this process is alone in them, and collectives treat a None group
    as a no-op, so the same layer code runs with or without parallelism.
    """

    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1
    cp_size: int = 1
    rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None  # the ranks that read different batches
    cp_group: dist.ProcessGroup | None = None
    dp_cp_group: dist.ProcessGroup | None = None  # DP x CP: gradients and optimizer shards
    # --num-distributed-optimizer-instances (module docstring); with one instance: dp_cp_group,
    # None and world_group
    dp_cp_shard_group: dist.ProcessGroup | None = None
    dp_cp_replica_group: dist.ProcessGroup | None = None
    optimizer_instance_group: dist.ProcessGroup | None = None
    optimizer_instances: int = 1
    # expert parallelism (parallel/expert_parallel/groups.py); with EP 1 and ETP = TP the
    # expert groups are the dense ones (None, dp_cp_group, tp_group)
    ep_size: int = 1
    etp_size: int = 1
    ep_group: dist.ProcessGroup | None = None
    ep_ranks: tuple[int, ...] = (0,)
    expert_dp_group: dist.ProcessGroup | None = None
    expert_tp_group: dist.ProcessGroup | None = None
    expert_tp_ep_pp_group: dist.ProcessGroup | None = None  # the experts' gradient norm
    model_parallel_group: dist.ProcessGroup | None = None  # TP x PP: one model replica
    embedding_group: dist.ProcessGroup | None = None  # first and last PP stage (tied embeddings)
    world_group: dist.ProcessGroup | None = None
    pp_ranks: tuple[int, ...] = (0,)  # global ranks of this rank's pipeline, stage by stage
    tp_ranks: tuple[int, ...] = (0,)
    dp_ranks: tuple[int, ...] = (0,)
    cp_ranks: tuple[int, ...] = (0,)
    pp_inside_dp: bool = False  # --use-tp-pp-dp-mapping

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp_size) % self.cp_size

    @property
    def dp_rank(self) -> int:
        outer = self.rank // (self.tp_size * self.cp_size)
        return outer // self.pp_size if self.pp_inside_dp else outer % self.dp_size

    @property
    def dp_cp_size(self) -> int:
        return self.dp_size * self.cp_size

    @property
    def pp_rank(self) -> int:
        outer = self.rank // (self.tp_size * self.cp_size)
        return outer % self.pp_size if self.pp_inside_dp else outer // self.dp_size

    @property
    def world_size(self) -> int:
        return self.tp_size * self.cp_size * self.pp_size * self.dp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def next_rank(self) -> int:
        """Global rank of the next pipeline stage (wraps around)."""
        return self.pp_ranks[(self.pp_rank + 1) % self.pp_size]

    @property
    def prev_rank(self) -> int:
        return self.pp_ranks[(self.pp_rank - 1) % self.pp_size]

    @classmethod
    def local(cls, device: torch.device | str = "cpu") -> ParallelState:
        """One process, no parallelism, no process groups (references, converters)."""
        return cls(device=torch.device(device))

    @classmethod
    def build(
        cls,
        tp: int = 1,
        pp: int = 1,
        dp: int | None = None,
        cp: int = 1,
        device: torch.device | str | None = None,
        backend: str | None = None,
        timeout_minutes: float | None = None,
        pp_inside_dp: bool = False,
        optimizer_instances: int = 1,
        ep: int = 1,
        etp: int | None = None,
    ) -> ParallelState:
        """Create every group of the (tp, cp, dp, pp) layout, in the default rank order or
        with `pp_inside_dp`, with `optimizer_instances` distributed-optimizer instances
        (the module docstring) and the expert groups of `ep` x `etp` (default TP);
        torch.distributed must be initialised."""
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised; call init_process_group first"
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        dp = check_layout(world, tp, pp, dp, cp)
        check_optimizer_instances(optimizer_instances, dp * cp)
        device = torch.device(device) if device is not None else torch.device("cpu")
        backend = backend or default_backend(device)
        timeout = datetime.timedelta(minutes=timeout_minutes) if timeout_minutes else None

        state = cls(tp_size=tp, pp_size=pp, dp_size=dp, cp_size=cp, rank=rank, device=device)
        state.pp_inside_dp = pp_inside_dp
        state.optimizer_instances = optimizer_instances

        def new_group(ranks: list[int]) -> dist.ProcessGroup | None:
            """Create the group on every rank; return it where this rank is a member.

            A group of one rank is not created at all (the decision is the same on every
            rank, so the collective new_group calls stay in step)."""
            if len(ranks) == 1:
                return None
            options = {"backend": backend}
            if timeout is not None:
                options["timeout"] = timeout
            group = dist.new_group(ranks, **options)
            return group if rank in ranks else None

        groups = layout_groups(tp, cp, dp, pp, pp_inside_dp, optimizer_instances)
        for ranks in groups["tp"]:
            group = new_group(ranks)
            if rank in ranks:
                state.tp_group, state.tp_ranks = group, tuple(ranks)
        for ranks in groups["cp"]:
            group = new_group(ranks)
            if rank in ranks:
                state.cp_group, state.cp_ranks = group, tuple(ranks)
        for ranks in groups["dp"]:
            group = new_group(ranks)
            if rank in ranks:
                state.dp_group, state.dp_ranks = group, tuple(ranks)
        for ranks in groups["dp_cp"]:
            group = new_group(ranks) if cp > 1 else None  # the same as the DP group
            if rank in ranks:
                state.dp_cp_group = group if cp > 1 else state.dp_group
        for ranks in groups["pp"]:
            group = new_group(ranks)
            embedding = new_group([ranks[0], ranks[-1]]) if pp > 1 else None
            if rank in ranks:
                state.pp_group, state.pp_ranks = group, tuple(ranks)
                state.embedding_group = embedding
        for ranks in groups["model"]:
            group = new_group(ranks)
            if rank in ranks:
                state.model_parallel_group = group
        state.world_group = new_group(list(range(world)))
        state.dp_cp_shard_group = state.dp_cp_group
        state.optimizer_instance_group = state.world_group
        _build_expert_groups(state, new_group, pp_inside_dp, ep, tp if etp is None else etp)
        if optimizer_instances > 1:
            for kind, attribute in (
                ("dp_cp_shard", "dp_cp_shard_group"),
                ("dp_cp_replica", "dp_cp_replica_group"),
                ("instance", "optimizer_instance_group"),
            ):
                for ranks in groups[kind]:
                    group = new_group(ranks)
                    if rank in ranks:
                        setattr(state, attribute, group)
        return state

    @property
    def ep_rank(self) -> int:
        return self.ep_ranks.index(self.rank) if self.ep_size > 1 else 0

    def describe(self) -> str:
        return (
            f"rank {self.rank}: tp {self.tp_rank}/{self.tp_size} cp {self.cp_rank}/{self.cp_size} "
            f"pp {self.pp_rank}/{self.pp_size} dp {self.dp_rank}/{self.dp_size} on {self.device}"
        )


def _build_expert_groups(state: ParallelState, new_group, pp_inside_dp: bool, ep: int, etp: int):
    """The expert groups (parallel/expert_parallel/groups.py), created on every rank."""
    state.ep_size, state.etp_size = ep, etp
    state.expert_dp_group, state.expert_tp_group = state.dp_cp_group, state.tp_group
    state.expert_tp_ep_pp_group = state.model_parallel_group
    if ep == 1 and etp == state.tp_size:
        return
    groups = expert_layout_groups(
        state.tp_size, state.cp_size, state.dp_size, state.pp_size, ep, etp, pp_inside_dp
    )
    for ranks in groups["ep"]:
        group = new_group(ranks)
        if state.rank in ranks:
            state.ep_group, state.ep_ranks = group, tuple(ranks)
    for kind, attribute in (
        ("expert_dp", "expert_dp_group"),
        ("expert_tp", "expert_tp_group"),
        ("expert_tp_ep_pp", "expert_tp_ep_pp_group"),
    ):
        for ranks in groups[kind]:
            group = new_group(ranks)
            if state.rank in ranks:
                setattr(state, attribute, group)


def rank_device(
    requested: str | None, local_rank: int, local_world_size: int, cuda_devices: int
) -> torch.device:
    """The device a rank computes on: `cuda:LOCAL_RANK` where there are GPUs (or with
    `--device cuda`), the CPU otherwise (or with `--device cpu`). ConfigError (one line) where
    that cannot be: no GPU for --device cuda, a local rank beyond the visible GPUs (two ranks on
    one GPU, which NCCL refuses), or `--device cuda:N` given to several ranks of a node."""
    kind = requested or ("cuda" if cuda_devices else "cpu")
    try:
        device = torch.device(kind)
    except (RuntimeError, ValueError):
        raise ConfigError(f"--device {kind}: give cpu or cuda") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ConfigError(f"--device {kind}: give cpu or cuda")
    if cuda_devices == 0:
        raise ConfigError(f"--device {kind}, but no CUDA device is available")
    index = local_rank
    if device.index is not None:
        if local_world_size > 1:
            raise ConfigError(
                f"--device {kind} puts all {local_world_size} ranks of a node on one GPU; give "
                "--device cuda (each rank takes cuda:LOCAL_RANK)"
            )
        index = device.index
    if index >= cuda_devices:
        raise ConfigError(
            f"local rank {local_rank} needs GPU {index}, but {cuda_devices} are visible "
            f"(CUDA_VISIBLE_DEVICES); start at most {cuda_devices} processes per node "
            "(--nproc-per-node)"
        )
    return torch.device("cuda", index)


def local_rank_and_size() -> tuple[int, int]:
    """This process's rank on its node and the node's process count (torchrun's LOCAL_RANK and
    LOCAL_WORLD_SIZE; one process by default)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1)))


def init_distributed(
    requested_device: str | None = None, timeout_minutes: float = 10.0
) -> tuple[int, int, torch.device]:
    """Initialise torch.distributed from torchrun's environment (RANK, WORLD_SIZE, ...) on
    this rank's device (`rank_device`: cuda:LOCAL_RANK with nccl where there are GPUs, else
    the CPU with gloo). Returns (rank, world_size, device)."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank, local_world = local_rank_and_size()
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = rank_device(requested_device, local_rank, local_world, cuda)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # One process started without torchrun: an in-memory store, no port to collide on.
        alone = world == 1 and "MASTER_PORT" not in os.environ
        dist.init_process_group(
            default_backend(device),
            store=dist.HashStore() if alone else None,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(minutes=timeout_minutes),
            # NCCL binds its communicators to this rank's GPU up front
            device_id=device if device.type == "cuda" else None,
        )
    return rank, world, device
