"""The one runtime that runs any schedule table (parallel/pipeline/tables.py) on this rank.

For each action of its list, in order:
- F: the chunk's forward on the micro-batch, from the previous virtual stage's output
  (received, or handed over on this rank when that stage is its own other chunk; the first
  stage starts from the batch); the last stage computes the loss. The output goes on to the
  next virtual stage.
- B: backward from the output (the last stage: from its loss) with the gradient the next
  stage sent; the input's gradient goes back to the previous stage.
- I: the same backward with the linear layers' weight-gradient GEMMs deferred into this
  micro-batch's queue (parallel/pipeline/weight_grad.py); W runs the queue.

Transfers. A result is sent as soon as it is computed, in one batch with the receive the next
action needs (as Megatron-LM pairs a stage's "send output" with its "receive gradient"); the
send is not waited for (it completes when its receiver takes it; its tensor is let go then,
and whatever is left at the end of the step is waited for), so a rank only ever waits for data
it needs, and on gloo a table whose data dependencies can be met in order
(parallel/pipeline/validate.py simulates it) cannot deadlock. Receives are waited for by the
action that needs them; with `overlap` the next two are kept posted ahead, so they arrive
during the computes before. Matching is by peer and tag (activation or gradient) in posting
order, which the validator checks each table keeps; NCCL ignores tags, so a table that mixes
the two kinds differently on the two sides of a pair of ranks (zb-v; dualpipe-v from p = 3)
is refused on NCCL (`pair_order_violation`). None of this has run on NCCL yet.

Data-parallel rules: gradients accumulate locally (DDP no-sync) until a chunk's last
micro-batch's backward (its W, when split), whose DDP may then reduce; with sharded gradients
every micro-batch's backward (B, or W) ends with the chunk's `end_backward`, and an I with
`end_input_backward` (sharded parameters gathered for it are released).

`stats` (optional) gets 'peak_held' (most micro-batches whose activations were held at once:
from F until B, or W), 'peak_output_bytes' (the most bytes held outputs took when a forward
started; sent outputs are freed), 'compute_s', 'computes_overlapped' (computes started with a
receive in flight) and, with `trace`, 'events' ((action, start, end) in seconds from the
step's start) for tools/show_schedule.py. `times` gets "forward-compute" and
"backward-compute".
"""

from __future__ import annotations

import time

import torch

from parallel.pipeline.p2p import backward_from, free_sent_output
from parallel.pipeline.tables import Action, Table
from parallel.pipeline.validate import pair_order_violation
from parallel.pipeline.weight_grad import WeightGradQueue
from parallel.timing import StepTimes, measure

ACTIVATION = "activation"  # the kind Table.link gives activations (gradients: "gradient")
LOOKAHEAD = 2  # receives posted ahead with overlap


class TableRuntime:
    """Runs this rank's list of `table` (module docstring)."""

    def __init__(
        self,
        table: Table,
        chunks,
        batches,
        forward_step,
        loss_func,
        *,
        p2p,
        forward_only: bool = False,
        stats: dict | None = None,
        times: StepTimes | None = None,
        overlap: bool = False,
        trace: bool = False,
    ):
        self.table, self.chunks, self.batches = table, chunks, batches
        self.forward_step, self.loss_func = forward_step, loss_func
        self.p2p, self.rank = p2p, p2p.state.pp_rank
        self.forward_only, self.overlap, self.times = forward_only, overlap, times
        self.stats = stats if stats is not None else {}
        self.stats.update(peak_held=0, peak_output_bytes=0, compute_s=0.0, computes_overlapped=0)
        if trace:
            self.stats["events"] = []
        self.order = [a for a in table.ranks[self.rank] if a.kind == "F" or not forward_only]
        violation = pair_order_violation(table)
        if violation and self._backend() == "nccl":
            raise ValueError(
                f"schedule {table.name}: {violation}; NCCL matches messages between two ranks "
                "in posting order whatever their kind, so this table cannot run on it yet "
                "(use gloo, or another schedule)"
            )
        self.losses: list[torch.Tensor] = []
        self.saved: dict = {}  # (chunk, k) -> (input, output or loss) until backward
        self.handed: dict = {}  # (kind, chunk, k) -> a tensor handed over on this rank
        self.received: dict = {}  # (kind, chunk, k) -> Transfer posted for it
        self.queues: dict = {}  # (chunk, k) -> WeightGradQueue of a split backward
        self.sends: list = []  # sends in flight (overlap)
        self.held = 0
        self.started = time.perf_counter()

    def _backend(self) -> str:
        group = self.p2p.state.pp_group
        return "none" if group is None else torch.distributed.get_backend(group)

    # --- where data comes from and goes to ------------------------------------------------

    def _link(self, action: Action, incoming: bool):
        return self.table.link(self.rank, action, incoming)

    def _remote_source(self, action: Action | None):
        if action is None:
            return None
        link = self._link(action, incoming=True)
        return link if link is not None and link[1] != self.rank else None

    def _post_receive(self, action: Action | None) -> None:
        """Post the receive `action` needs (overlap mode), unless posted already."""
        source = self._remote_source(action)
        key = source and (source[0], action.chunk, action.microbatch)
        if source is not None and key not in self.received:
            self.received[key] = self.p2p.post_to(recv_from=(source[1], source[0]))

    def _take(self, action: Action):
        """The tensor `action` needs (waited for when in flight), or None."""
        link = self._link(action, incoming=True)
        if link is None:
            return None
        key = (link[0], action.chunk, action.microbatch)
        if link[1] == self.rank:
            return self.handed.pop(key)
        if key not in self.received:  # the step's first receive, or after a local hand-over
            self.received[key] = self.p2p.post_to(recv_from=(link[1], link[0]))
        return self.received.pop(key).wait()

    def _after(self, index: int, action: Action, result) -> None:
        """Send (or hand over) `result`, in one batch with the receive the next action needs
        (module docstring); with overlap, keep receives posted ahead."""
        link = self._link(action, incoming=False)
        send = None
        if link is not None and result is not None:
            kind, rank, chunk = link
            if rank == self.rank:
                handed = result.detach().requires_grad_(kind == ACTIVATION)
                self.handed[kind, chunk, action.microbatch] = handed
            else:
                send = (result, rank, kind)
        self.sends = [transfer for transfer in self.sends if not transfer.sent()]
        if send is not None:
            upcoming = self.order[index + 1] if index + 1 < len(self.order) else None
            source = self._remote_source(upcoming)
            key = source and (source[0], upcoming.chunk, upcoming.microbatch)
            receive = (source[1], source[0]) if source and key not in self.received else None
            transfer = self.p2p.post_to(send=send, recv_from=receive)
            self.sends.append(transfer)
            if receive is not None:
                self.received[key] = transfer
            if action.kind == "F":
                free_sent_output(result)
        if self.overlap:
            self._receive_ahead(index)

    def _receive_ahead(self, index: int) -> None:
        """Post the receives of the next LOOKAHEAD actions that need one (in table order, as
        matching by peer and tag needs)."""
        wanted = 0
        for action in self.order[index + 1 :]:
            if self._remote_source(action) is None:
                continue
            self._post_receive(action)
            wanted += 1
            if wanted == LOOKAHEAD:
                return

    # --- compute -----------------------------------------------------------------------------

    def _start_compute(self) -> float:
        self.stats["computes_overlapped"] += any(t.in_flight for t in self.received.values())
        return time.perf_counter()

    def _end_compute(self, action: Action, start: float) -> None:
        end = time.perf_counter()
        self.stats["compute_s"] += end - start
        if "events" in self.stats:
            self.stats["events"].append((str(action), start - self.started, end - self.started))

    def _forward(self, index: int, action: Action) -> None:
        c, k = action.chunk, action.microbatch
        input_tensor = self._take(action)
        last = self.table.stage(self.rank, c) == self.table.stages - 1
        held = sum(o.untyped_storage().nbytes() for _, o in self.saved.values())
        self.stats["peak_output_bytes"] = max(self.stats["peak_output_bytes"], held)
        start = self._start_compute()
        with torch.set_grad_enabled(not self.forward_only), measure(self.times, "forward-compute"):
            output = self.forward_step(self.chunks[c], self.batches[k], input_tensor)
            if last:
                output, reported = self.loss_func(output, self.batches[k])
                self.losses.append(reported)
        self._end_compute(action, start)
        if not self.forward_only:
            self.saved[c, k] = (input_tensor, output)
            self.held += 1
            self.stats["peak_held"] = max(self.stats["peak_held"], self.held)
        self._after(index, action, None if last else output)

    def _backward(self, index: int, action: Action) -> None:
        c, k = action.chunk, action.microbatch
        output_grad = self._take(action)
        input_tensor, output = self.saved.pop((c, k))
        if input_tensor is not None:
            input_tensor.retain_grad()
        start = self._start_compute()
        with measure(self.times, "backward-compute"):
            if action.kind == "I":
                queue = WeightGradQueue()
                ddp, last = self.chunks[c], k == self.table.m - 1
                if hasattr(ddp, "is_last_microbatch"):  # norms and biases get theirs now
                    ddp.is_last_microbatch = last
                with queue.collecting(ddp.parameters()):
                    backward_from(output, output_grad)
                end = getattr(ddp, "end_input_backward", None)
                if end is not None:
                    end()
                if hasattr(ddp, "is_last_microbatch"):
                    ddp.is_last_microbatch = True
                self.queues[c, k] = queue
            else:
                self._accumulate(c, k, lambda: backward_from(output, output_grad))
                self.held -= 1
        self._end_compute(action, start)
        self._after(index, action, input_tensor.grad if input_tensor is not None else None)

    def _weights(self, index: int, action: Action) -> None:
        c, k = action.chunk, action.microbatch
        queue = self.queues.pop((c, k))
        start = self._start_compute()
        with measure(self.times, "backward-compute"):
            self._accumulate(c, k, queue.run)
        self._end_compute(action, start)
        self.held -= 1
        self._after(index, action, None)

    def _accumulate(self, chunk: int, k: int, work) -> None:
        """`work` adds micro-batch k's gradients of a chunk: DDP reduces only after the last
        micro-batch's (no-sync before); sharded gradients end every micro-batch's backward."""
        ddp, last = self.chunks[chunk], k == self.table.m - 1
        if hasattr(ddp, "is_last_microbatch"):
            ddp.is_last_microbatch = last
        work()
        end = getattr(ddp, "end_backward", None)
        if end is not None:
            end()
        if hasattr(ddp, "is_last_microbatch"):
            ddp.is_last_microbatch = True

    def run(self) -> list[torch.Tensor]:
        run = {"F": self._forward, "B": self._backward, "I": self._backward, "W": self._weights}
        if self.overlap:
            self._receive_ahead(-1)
        for index, action in enumerate(self.order):
            run[action.kind](index, action)
        for transfer in self.sends:
            transfer.wait_sent()
        return self.losses
