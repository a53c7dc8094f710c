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

Transfers follow the table's plan (parallel/pipeline/plan.py), made for all ranks at once so
that it runs on NCCL as on gloo (parallel/pipeline/transport.py checks both): every rank posts
its sends and receives in one global order, a send right after its compute (in one batch with
the next compute's receives; a receive posted further ahead goes alone). A receive is waited
for before the next compute, or with `overlap` just before the compute that needs it, so it
arrives during the computes before; sends are not waited for (one completes when its
receiver takes it; its tensor is let go then, and whatever is left at the end of the step is
waited for). A result handed to this rank's own other chunk skips the plan.

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
from parallel.pipeline.plan import Compute, Post, plan_transfers
from parallel.pipeline.plan import forward_only as forwards_of
from parallel.pipeline.tables import Action, Table
from parallel.pipeline.weight_grad import WeightGradQueue
from parallel.timing import StepTimes, measure

ACTIVATION = "activation"  # the kind Table.link gives activations (gradients: "gradient")


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
        self.forward_only, self.times = forward_only, times
        self.stats = stats if stats is not None else {}
        self.stats.update(peak_held=0, peak_output_bytes=0, compute_s=0.0, computes_overlapped=0)
        if trace:
            self.stats["events"] = []
        run = forwards_of(table) if forward_only else table
        self.plan = plan_transfers(run, overlap).ranks[self.rank]
        self.losses: list[torch.Tensor] = []
        self.saved: dict = {}  # (chunk, k) -> (input, output or loss) until backward
        self.handed: dict = {}  # (kind, chunk, k) -> a tensor handed over on this rank
        self.outbox: dict = {}  # producing action -> its result, until posted
        self.posted: dict = {}  # batch number -> (Transfer, its receives' consumers)
        self.inbox: dict = {}  # consuming action -> received tensor, once waited for
        self.sends: list = []  # transfers whose sends may be in flight
        self.queues: dict = {}  # (chunk, k) -> WeightGradQueue of a split backward
        self.held = 0
        self.started = time.perf_counter()

    # --- where data comes from and goes to ------------------------------------------------

    def _post(self, post: Post) -> None:
        sends = []
        for message in post.sends:
            result = self.outbox.pop(message.producer)
            sends.append((result, message.receiver, message.kind))
        receives = [(message.sender, message.kind) for message in post.receives]
        transfer = self.p2p.post_batch(sends, receives)
        if post.receives:
            self.posted[post.batch] = (transfer, [m.consumer for m in post.receives])
        self.sends = [t for t in self.sends if not t.sent()]
        if post.sends:
            self.sends.append(transfer)
        for result, _, kind in sends:
            if kind == ACTIVATION:
                free_sent_output(result)

    def _wait(self, batch: int) -> None:
        transfer, consumers = self.posted.pop(batch)
        self.inbox.update(zip(consumers, transfer.wait(), strict=False))

    def _take(self, action: Action):
        """The tensor `action` needs (received and waited for, or handed over), or None."""
        link = self.table.link(self.rank, action, incoming=True)
        if link is None:
            return None
        if link[1] == self.rank:
            return self.handed.pop((link[0], action.chunk, action.microbatch))
        return self.inbox.pop(action)

    def _after(self, action: Action, result) -> None:
        """Hand `result` over to this rank's own other chunk, or keep it for its post."""
        link = self.table.link(self.rank, action, incoming=False)
        if link is None:
            return
        kind, rank, chunk = link
        if result is None:
            raise RuntimeError(f"pipeline rank {self.rank}: {action} has no result to send")
        if rank == self.rank:
            self.handed[kind, chunk, action.microbatch] = result.detach().requires_grad_(
                kind == ACTIVATION
            )
        else:
            self.outbox[action] = result

    # --- compute -----------------------------------------------------------------------------

    def _start_compute(self) -> float:
        self.stats["computes_overlapped"] += any(t.in_flight for t, _ in self.posted.values())
        return time.perf_counter()

    def _end_compute(self, action: Action, start: float) -> None:
        end = time.perf_counter()
        self.stats["compute_s"] += end - start
        if "events" in self.stats:
            self.stats["events"].append((str(action), start - self.started, end - self.started))

    def _forward(self, action: Action) -> None:
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
        self._after(action, None if last else output)

    def _backward(self, action: Action) -> None:
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
        self._after(action, input_tensor.grad if input_tensor is not None else None)

    def _weights(self, action: Action) -> None:
        c, k = action.chunk, action.microbatch
        queue = self.queues.pop((c, k))
        start = self._start_compute()
        with measure(self.times, "backward-compute"):
            self._accumulate(c, k, queue.run)
        self._end_compute(action, start)
        self.held -= 1

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
        for step in self.plan:
            if isinstance(step, Compute):
                run[step.action.kind](step.action)
            elif isinstance(step, Post):
                self._post(step)
            else:
                self._wait(step.batch)
        for transfer in self.sends:
            transfer.wait_sent()
        return self.losses
