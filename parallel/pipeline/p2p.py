"""Point-to-point transfers between neighbouring pipeline stages.

Every transfer of a schedule step goes through `exchange`, one batch of isend/irecv (posted
together, then waited), so a stage can send forward and receive backward at once without
deadlock. Shapes are known ahead ([s, micro-batch, h], with s divided by TP under sequence
parallelism), so no shape metadata is exchanged. Neighbours wrap around: the last stage's
next rank is the first stage, which the interleaved schedule uses between model chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.state import ParallelState

ACTIVATION_TAG, GRADIENT_TAG = 1, 2


@dataclass
class P2P:
    """Transfers of [tensor_shape] tensors of `dtype` between this rank's pipeline neighbours."""

    state: ParallelState
    tensor_shape: tuple[int, ...]
    dtype: torch.dtype

    def _buffer(self) -> torch.Tensor:
        return torch.empty(self.tensor_shape, dtype=self.dtype, device=self.state.device)

    def exchange(
        self,
        send_next: torch.Tensor | None = None,
        send_prev: torch.Tensor | None = None,
        recv_prev: bool = False,
        recv_next: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Send to / receive from the previous and next stage in one batch; returns
        (tensor from prev, tensor from next). Received tensors require grad (they are a
        stage's inputs, or gradients that backward consumes as they are)."""
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
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if from_prev is not None:
            from_prev.requires_grad_(True)
        return from_prev, from_next

    # Named helpers for readability in the schedules.
    def recv_forward(self, receive: bool = True) -> torch.Tensor | None:
        return self.exchange(recv_prev=receive)[0]

    def send_forward(self, output: torch.Tensor | None) -> None:
        self.exchange(send_next=output)

    def recv_backward(self, receive: bool = True) -> torch.Tensor | None:
        return self.exchange(recv_next=receive)[1]

    def send_backward(self, input_grad: torch.Tensor | None) -> None:
        self.exchange(send_prev=input_grad)
