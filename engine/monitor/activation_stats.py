"""--log-activation-stats: the RMS and the largest magnitude of each transformer layer's output
over a step's global batch, at the log interval (growing activations are an early sign of an
unstable run, as the guides note).

A forward hook on every layer of this rank's model chunks adds, while armed, the output's sum
of squares, element count and largest |x|. The sums are then added over every rank and the
maxima taken: data-parallel and context-parallel ranks hold other tokens, a pipeline stage
only its own layers (the others add zeros), and tensor-parallel ranks either the same output
(replicated: both sums scale by the same factor, so the RMS is exact) or their sequence shards
(sequence parallelism). A layer recomputed in backward (activation recomputation) adds its
output twice, again both sums alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class ActivationStats:
    def __init__(self, chunks, num_layers: int, device: torch.device):
        self.num_layers, self.device = num_layers, device
        self.sums = torch.zeros(num_layers, 2, dtype=torch.float64, device=device)
        self.largest = torch.zeros(num_layers, dtype=torch.float64, device=device)
        self.armed = False
        for chunk in chunks:
            module = chunk.module if hasattr(chunk, "module") else chunk
            for number, layer in module.layers.items():
                layer.register_forward_hook(self._hook(int(number)))

    def _hook(self, number: int):
        def record(module, inputs, output) -> None:
            if not self.armed:
                return
            x = (output[0] if isinstance(output, tuple) else output).detach()
            self.sums[number, 0] += x.float().square().sum(dtype=torch.float64)
            self.sums[number, 1] += x.numel()
            self.largest[number] = torch.maximum(self.largest[number], x.abs().max().double())

        return record

    def arm(self) -> None:
        """Start counting a step's forward passes."""
        self.sums.zero_()
        self.largest.zero_()
        self.armed = True

    def collect(self, world_group) -> dict[str, float]:
        """`act_rms/layers.N` and `act_max/layers.N` of the step counted since arm().
        Collective over every rank."""
        self.armed = False
        sums, largest = self.sums.clone(), self.largest.clone()
        if world_group is not None:
            dist.all_reduce(sums, group=world_group)
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=world_group)
        out = {}
        for n, ((square, count), top) in enumerate(
            zip(sums.tolist(), largest.tolist(), strict=True)
        ):
            if count:
                out[f"act_rms/layers.{n}"] = (square / count) ** 0.5
                out[f"act_max/layers.{n}"] = top
        return out
