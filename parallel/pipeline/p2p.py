"""Point-to-point transfers between pipeline stages.

The schedule runtime (parallel/pipeline/runtime.py) posts its planned batches
(parallel/pipeline/plan.py) with `post_batch`: sends to and receives from pipeline ranks as
one batch of isend/irecv; the receives are waited for as planned and the sends complete on
their own. `post` and `exchange` (sends and receives with the next and previous
stage; `exchange` waits at once) remain for direct use. Shapes are known ahead ([s,
micro-batch, h], with s divided by TP under sequence parallelism), so no shape metadata is
exchanged. Activations and gradients have their own tags.

Once posted, a stage's output activation is needed only as the root of its autograd graph: the
runtime frees its data with `free_sent_output` (the transfer keeps its own reference until the
send completes), and `backward_from` runs backward from such a root, as Megatron-LM does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.variable import Variable

from parallel.state import ParallelState
from parallel.timing import StepTimes, measure

ACTIVATION_TAG, GRADIENT_TAG = 1, 2
TAGS = {"activation": ACTIVATION_TAG, "gradient": GRADIENT_TAG}


@dataclass
class Pending:
    """Transfers in flight. The sent tensors are kept alive until they complete. Received
    tensors require grad once waited for (they are a stage's inputs, or gradients that
    backward consumes as they are)."""

    works: list
    buffers: list[torch.Tensor]
    from_prev: torch.Tensor | None
    from_next: torch.Tensor | None
    times: StepTimes | None = None  # counts the waiting as "pipeline-wait"

    def wait(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        with measure(self.times, "pipeline-wait"):
            for work in self.works:
                work.wait()
        self.works, self.buffers = [], []
        if self.from_prev is not None:
            self.from_prev.requires_grad_(True)
        return self.from_prev, self.from_next


@dataclass
class Transfer:
    """One batch of `P2P.post_batch` in flight: `wait()` waits for its receives and returns
    their tensors in order (activations require grad: they are a stage's inputs); its sends
    complete on their own (`sent()`, `wait_sent()`). Where the backend coalesces the batch
    into one work (NCCL), waiting for the receives waits for the sends too."""

    send_works: list
    recv_works: list
    buffers: list[torch.Tensor]
    received: list[torch.Tensor]
    activation: list[bool]
    times: StepTimes | None = None

    @property
    def in_flight(self) -> bool:
        """A receive not waited for yet."""
        return bool(self.recv_works)

    def wait(self) -> list[torch.Tensor]:
        with measure(self.times, "pipeline-wait"):
            for work in self.recv_works:
                work.wait()
        self.recv_works = []
        for tensor, activation in zip(self.received, self.activation, strict=False):
            if activation:
                tensor.requires_grad_(True)
        return self.received

    def sent(self) -> bool:
        """Whether the sends are done (their tensors then released)."""
        if all(work.is_completed() for work in self.send_works):
            self.send_works, self.buffers = [], []
            return True
        return False

    def wait_sent(self) -> None:
        with measure(self.times, "pipeline-wait"):
            for work in self.send_works:
                work.wait()
        self.send_works, self.buffers = [], []


@dataclass
class P2P:
    """Transfers of [tensor_shape] tensors of `dtype` between this rank's pipeline neighbours."""

    state: ParallelState
    tensor_shape: tuple[int, ...]
    dtype: torch.dtype
    times: StepTimes | None = None  # counts waits for transfers as "pipeline-wait"

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.tensor_shape, dtype=self.dtype, device=self.state.device)

    def post(
        self,
        send_next: torch.Tensor | None = None,
        send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> Pending:
        """Start sends to / receives from the previous and next stage as one batch, without
        waiting; `Pending.wait()` returns (tensor from prev, tensor from next)."""
        state = self.state
        from_prev = self._buffer() if recv_prev else None
        from_next = self._buffer() if recv_next else None
        # Activations first, then gradients, each with its own tag: with two stages the
        # previous and next rank are the same process, and messages between one pair of ranks
        # are matched in posting order (NCCL ignores tags), so both sides must agree on it.
        wanted = [
            (dist.isend, send_next, state.next_rank, ACTIVATION_TAG),
            (dist.irecv, from_prev, state.prev_rank, ACTIVATION_TAG),
            (dist.isend, send_prev, state.prev_rank, GRADIENT_TAG),
            (dist.irecv, from_next, state.next_rank, GRADIENT_TAG),
        ]
        ops = [
            dist.P2POp(
                op,
                tensor.detach().contiguous() if op is dist.isend else tensor,
                peer,
                state.pp_group,
                tag,
            )
            for op, tensor, peer, tag in wanted
            if tensor is not None
        ]
        with measure(self.times, "pipeline-wait"):
            works = dist.batch_isend_irecv(ops) if ops else []
        return Pending(works, [op.tensor for op in ops], from_prev, from_next, self.times)

    def exchange(
        self,
        send_next: torch.Tensor | None = None,
        send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`post` and wait: returns (tensor from prev, tensor from next)."""
        return self.post(send_next, send_prev, recv_prev, recv_next).wait()

    def post_batch(
        self,
        sends: list[tuple[torch.Tensor, int, str]],
        receives: list[tuple[int, str]],
    ) -> Transfer:
        """One batch, not waited for: each send (tensor, pipeline rank, kind), each receive
        (pipeline rank, kind), kind "activation" or "gradient" (its tag). The schedule
        runtime's transfers (parallel/pipeline/runtime.py, planned in plan.py)."""
        state, ops, received = self.state, [], []
        for tensor, peer, kind in sends:
            ops.append(dist.P2POp(dist.isend, tensor.detach().contiguous(),
                                  state.pp_ranks[peer], state.pp_group, TAGS[kind]))  # fmt: skip
        for peer, kind in receives:
            received.append(self._buffer())
            ops.append(dist.P2POp(dist.irecv, received[-1], state.pp_ranks[peer],
                                  state.pp_group, TAGS[kind]))  # fmt: skip
        with measure(self.times, "pipeline-wait"):
            works = dist.batch_isend_irecv(ops) if ops else []
        if len(works) == len(ops):
            send_works, recv_works = works[: len(sends)], works[len(sends) :]
        else:  # coalesced into one work
            send_works, recv_works = works, works if receives else []
        activation = [kind == "activation" for _, kind in receives]
        buffers = [op.tensor for op in ops]
        return Transfer(send_works, recv_works, buffers, received, activation, self.times)

    # Named helpers for readability in the schedules.
    def recv_forward(self, receive: bool = True) -> torch.Tensor | None:
        return self.exchange(recv_prev=receive)[0]

    def send_forward(self, output: torch.Tensor | None) -> None:
        self.exchange(send_next=output)

    def recv_backward(self, receive: bool = True) -> torch.Tensor | None:
        return self.exchange(recv_next=receive)[1]

    def send_backward(self, input_grad: torch.Tensor | None) -> None:
        self.exchange(send_prev=input_grad)


def free_sent_output(output: torch.Tensor | None) -> None:
    """After `post` took the output for sending: drop its data, keep its autograd graph. Views
    are left alone (their data belongs to another tensor)."""
    if output is None or output._base is not None or output.grad_fn is None:
        return
    output.data = torch.empty((1,), dtype=output.dtype, device=output.device)


def backward_from(output: torch.Tensor, output_grad: torch.Tensor | None) -> None:
    """Backward from a stage output whose data may have been freed: the gradient's shape is
    checked against the graph's record of the output, not against the emptied tensor."""
    if output_grad is None:
        torch.autograd.backward(output)
        return
    Variable._execution_engine.run_backward((output,), (output_grad,), False, False, (), True, True)
