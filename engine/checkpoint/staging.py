"""Host memory an asynchronous save copies the state into, and the copy itself.

All the state's tensors get views into one host allocation (pinned when the state is on a GPU):
one pinned block, not one per tensor rounded up by the caching host allocator. The copy runs in
the save's background thread, on the rank's own GPU (a thread starts on GPU 0 whatever its
process uses), on a side stream that first waits for the training stream's work up to the save,
and the thread waits for the copy's own completion event, so the bytes written and checksummed
are the copied ones.
"""

from __future__ import annotations

import torch

from parallel.checkpoint.dcp import BoxTensor

ALIGN = 64  # bytes: every view starts aligned for any dtype


def _tensors(state: dict):
    """(key, box index or None, tensor) for every tensor of the state, in a fixed order."""
    for key, value in state.items():
        if isinstance(value, BoxTensor):
            for index, (_, tensor) in enumerate(value.boxes):
                yield key, index, tensor
        else:
            yield key, None, value


def _nbytes(tensor: torch.Tensor) -> int:
    size = tensor.numel() * tensor.element_size()
    return (size + ALIGN - 1) // ALIGN * ALIGN


class HostStaging:
    """Host copies shaped like a state's tensors (see the module docstring)."""

    def __init__(self, state: dict, device: torch.device):
        self.device = device
        pin = device.type == "cuda"
        total = sum(_nbytes(t) for _, _, t in _tensors(state))
        self.block = torch.empty(max(total, ALIGN), dtype=torch.uint8, pin_memory=pin)
        self.block.zero_()  # touched once, so later copies cost no page faults
        views, offset = {}, 0
        for key, index, tensor in _tensors(state):
            size = tensor.numel() * tensor.element_size()
            view = self.block[offset : offset + size].view(tensor.dtype).view(tensor.shape)
            views[(key, index)] = view
            offset += _nbytes(tensor)
        self.tensors = {}
        for key, value in state.items():
            if isinstance(value, BoxTensor):
                boxes = [(o, views[(key, i)]) for i, (o, _) in enumerate(value.boxes)]
                self.tensors[key] = BoxTensor(value.global_shape, value.dtype, boxes)
            else:
                self.tensors[key] = views[(key, None)]

    def matches(self, state: dict) -> bool:
        """Whether state has the same keys and shapes (the buffers can be reused)."""
        if self.tensors.keys() != state.keys():
            return False
        mine = [(k, i, t.shape, t.dtype) for k, i, t in _tensors(self.tensors)]
        theirs = [(k, i, t.shape, t.dtype) for k, i, t in _tensors(state)]
        return mine == theirs

    def mark_ready(self):
        """In the training thread, at the save: an event after the work that produced the
        state (None on the CPU)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy_from(self, state: dict, ready) -> dict:
        """In the save's thread: copy state into the host views and return them, complete."""
        pairs = [
            (self.tensors[k] if i is None else self.tensors[k].boxes[i][1], t)
            for k, i, t in _tensors(state)
        ]
        if self.device.type != "cuda":
            for target, source in pairs:
                target.copy_(source)
            return self.tensors
        if self.device.index is not None:  # the thread starts on GPU 0, not the rank's
            torch.cuda.set_device(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_event(ready)
        with torch.cuda.stream(stream):
            for target, source in pairs:
                target.copy_(source, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
        return self.tensors
