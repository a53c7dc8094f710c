"""Point-to-point transfers between pipeline stages.

The schedule runtime (parallel/pipeline/runtime.py) posts each transfer with `post_to`: a send
to a pipeline rank and the receive the next action needs from one, as one batch of
isend/irecv, so the two go out together; the receive is waited for when needed and the send
completes on its own. `post` and `exchange` (sends and receives with the next and previous
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
    """One batch of `P2P.post_to` in flight: `wait()` waits for its receive and returns the
    tensor (an activation requires grad: it is a stage's input); its send completes on its own
    (`sent()`, `wait_sent()`). Where the backend coalesces the batch into one work (NCCL),
    waiting for the receive waits for the send too."""

    send_works: list
    recv_works: list
    buffers: list[torch.Tensor]
    received: torch.Tensor | None
    activation: bool
    times: StepTimes | None = None

    @property
    def in_flight(self) -> bool:
        """A receive not waited for yet."""
        return bool(self.recv_works)

    def wait(self) -> torch.Tensor | None:
        with measure(self.times, "pipeline-wait"):
            for work in self.recv_works:
                work.wait()
        self.recv_works = []
        if self.received is not None and self.activation:
            self.received.requires_grad_(True)
        return self.received

    def sent(self) -> bool:
        """Whether the send is done (its tensor then released)."""
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

    def post_to(
        self,
        send: tuple[torch.Tensor, int, str] | None = None,
        recv_from: tuple[int, str] | None = None,
    ) -> Transfer:
        """One batch, not waited for: `send` = (tensor, pipeline rank, kind), `recv_from` =
        (pipeline rank, kind), kind "activation" or "gradient" (its tag). For schedules whose
        neighbours are not just the next and previous stage (parallel/pipeline/runtime.py)."""
        state, ops, received = self.state, [], None
        if send is not None:
            tensor, peer, kind = send
            ops.append(dist.P2POp(dist.isend, tensor.detach().contiguous(),
                                  state.pp_ranks[peer], state.pp_group, TAGS[kind]))  # fmt: skip
        if recv_from is not None:
            peer, kind = recv_from
            received = self._buffer()
            ops.append(dist.P2POp(dist.irecv, received, state.pp_ranks[peer], state.pp_group,
                                  TAGS[kind]))  # fmt: skip
        with measure(self.times, "pipeline-wait"):
            works = dist.batch_isend_irecv(ops) if ops else []
        sends = int(send is not None)
        if len(works) == len(ops):
            send_works, recv_works = works[:sends], works[sends:]
        else:  # coalesced into one work
            send_works = recv_works = works
        activation = recv_from is not None and recv_from[1] == "activation"
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
