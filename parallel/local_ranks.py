"""Run a function on N local gloo ranks: a TCP store the caller hosts on a port the system
picks (never picked, closed and reused), one thread per rank, a timeout, and the traceback of
the rank that failed first. Used by the tests and the CPU benchmarks; real jobs
launch through torchrun (examples/pretrain_gpt.sh).

Ranks are forked from a forkserver: a freshly started process that has imported torch and the
engine (`_PRELOAD`) and run nothing, so they start in milliseconds and never inherit the
caller's thread pools. (A plain fork of a process whose OpenMP pool is running, e.g. after
SentencePiece trained a unigram model, deadlocks the child's first multi-threaded torch op.)
`fn` and its arguments must therefore be picklable: a module-level function and plain data.

A rank that finished stays until every rank has finished (`_leave_together`), so that it does
not take a gloo connection away from a slower one.

Each rank's stdout and stderr go to a file that the caller's own stdout/stderr receive when the
ranks are done, rank by rank; a rank that hangs past the timeout first dumps its stacks there.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

# What every rank imports anyway, imported once in the forkserver: a rank forked from it starts
# with these in memory instead of spending seconds of CPU importing them (torch.compile's and
# DCP's modules alone take about 2 s of a core per rank).
_PRELOAD = [
    "numpy",
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.tensor",
    "torch._dynamo",
    "engine.pretrain",
]


def _entry(fn, rank, world_size, port, conn, threads, cpu_only, log_paths, args, kwargs):
    for fd, path in zip((1, 2), log_paths, strict=False):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    faulthandler.enable(all_threads=True)  # a crash (SIGSEGV, SIGABRT) leaves its stacks
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stack dump when stuck
    status, payload, store = "error", None, None
    try:
        os.environ.update(
            OMP_NUM_THREADS=str(threads),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
        )
        if cpu_only:  # gloo ranks on the CPU must not take (and collide on) a machine's GPUs
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        torch.set_num_threads(threads)
        timeout = datetime.timedelta(seconds=120)
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        payload = fn(rank, world_size, *args, **kwargs)
        status = "ok"
    except BaseException:  # noqa: BLE001 - every failure is reported to the parent
        payload = traceback.format_exc()
    failed_at = time.time()
    try:
        conn.send_bytes(pickle.dumps((status, payload, failed_at)))
    except Exception:  # noqa: BLE001 - an unpicklable result: report that instead
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc(), failed_at)))
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        _leave_together(store, world_size, wait=status == "ok")
        # os._exit skips the clean-up that would end this rank's own child processes (a
        # multiprocessing Manager megatron-core's checkpoint writer starts, for one): end them
        # here, or each would outlive the test as an orphan holding its memory.
        for child in multiprocessing.active_children():
            child.kill()
        os._exit(0)


def _leave_together(store, world_size: int, wait: bool) -> None:
    """Check out; with `wait`, stay until every rank has checked out.

    A rank that finished early must not take its end of a gloo connection away while a slower
    rank is still setting up a group with it: that rank would fail with "connectFullMesh
    failed" (measured: 80 of 150 runs of a bare new_group on four ranks sharing two busy
    cores). A rank that failed checks out without waiting; the wait is bounded by the store's
    timeout, and run_local kills a rank that hangs."""
    if store is None:
        return
    try:
        if store.add("run_local/finished", 1) == world_size:
            store.set("run_local/all_finished", "1")
        if wait:
            store.wait(["run_local/all_finished"])
    except Exception:  # noqa: BLE001 - the host or a peer is already gone: nothing to protect
        pass


def _context(also_preload: tuple[str, ...]):
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([*_PRELOAD, *also_preload])
    return context


def start_forkserver(also_preload: tuple[str, ...] = ()) -> None:
    """Start this process's forkserver now, with the ranks' preload. A process has one
    forkserver, whose preload is the list set when it started: a program that also runs
    other forkserver pools (preprocessing's, which import no torch) calls this before them,
    or its ranks would each import torch and the engine themselves (seconds of a core each)."""
    from multiprocessing import forkserver

    _context(also_preload)
    forkserver.ensure_running()


def _echo_logs(logs: list[tuple[str, str]]) -> None:
    """Each rank's captured output, in rank order, to our own stdout and stderr."""
    sys.stdout.flush()
    sys.stderr.flush()
    for rank, (out_path, err_path) in enumerate(logs):
        for fd, path in ((1, out_path), (2, err_path)):
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                continue
            if data:
                if fd == 2:
                    data = f"[rank {rank} stderr]\n".encode() + data
                os.write(fd, data)


def run_local(
    fn,
    world_size: int,
    *args,
    timeout: float = 240.0,
    threads: int = 1,
    cpu_only: bool = True,
    also_preload: tuple[str, ...] = (),
    **kwargs,
):
    """fn(rank, world_size, *args, **kwargs) on world_size local gloo ranks; returns each
    rank's result, or raises AssertionError carrying the traceback of the rank that failed
    first (the others usually fail only because it went away). The ranks see no GPU unless
    cpu_only is False (a benchmark of one process on one GPU). `also_preload` names modules the
    ranks import beyond the engine's (one that fails to import is skipped); it counts only if
    this call starts the process's forkserver (see start_forkserver)."""
    context = _context(also_preload)
    # Hosted here, on a port the system assigns while binding it, for as long as the ranks run.
    server = dist.TCPStore(
        "127.0.0.1", 0, None, True, datetime.timedelta(seconds=120), wait_for_workers=False
    )
    port = server.port
    folder = tempfile.mkdtemp(prefix="ranks-")
    logs = [
        (os.path.join(folder, f"{r}.out"), os.path.join(folder, f"{r}.err"))
        for r in range(world_size)
    ]
    pipes, processes = [], []
    for rank in range(world_size):
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(
            target=_entry,
            args=(fn, rank, world_size, port, sender, threads, cpu_only, logs[rank], args, kwargs),
            # Not daemonic: a rank may start DataLoader worker processes of its own (the
            # finally below kills every rank that is still alive).
            daemon=False,
        )
        process.start()
        sender.close()
        pipes.append(receiver)
        processes.append(process)
    results: list = [None] * world_size
    failures: list[tuple[float, int, str]] = []
    pending = set(range(world_size))
    deadline = time.monotonic() + timeout
    grace_until = None
    try:
        while pending:
            for rank in sorted(pending):
                if pipes[rank].poll(0.01):
                    try:
                        status, payload, when = pickle.loads(pipes[rank].recv_bytes())
                    except EOFError:
                        status, payload, when = "error", "the process died", time.time()
                    pending.discard(rank)
                    if status == "ok":
                        results[rank] = payload
                    else:
                        failures.append((when, rank, payload))
                elif not processes[rank].is_alive() and not pipes[rank].poll(0):
                    code = processes[rank].exitcode
                    pending.discard(rank)
                    failures.append((time.time(), rank, f"died with exit code {code}"))
            if failures and grace_until is None:
                grace_until = time.monotonic() + 2.0  # let the first failure's report arrive
            if grace_until is not None and time.monotonic() > grace_until:
                break
            if time.monotonic() > deadline:
                for rank in pending:  # each stuck rank writes its stacks to its log
                    if processes[rank].is_alive():
                        os.kill(processes[rank].pid, signal.SIGUSR1)
                time.sleep(1.0)
                raise AssertionError(
                    f"timed out after {timeout:.0f}s; ranks {sorted(pending)} did not finish "
                    "(their stacks are in the rank output above)"
                )
        if failures:
            _, rank, payload = min(failures)
            failed = {r for _, r, _ in failures}
            others = ", ".join(
                f"{r} " + ("running" if r in pending else "failed" if r in failed else "ok")
                for r in range(world_size)
                if r != rank
            )
            raise AssertionError(
                f"rank {rank} of {world_size} failed (the others: {others}):\n{payload}"
            )
    finally:
        # Ranks that reported are on their way out, ending their own children: let them (a
        # kill now would orphan those). Ranks still running after a failure are killed.
        settle_until = time.monotonic() + (10.0 if not pending and not failures else 0.0)
        for process in processes:
            process.join(timeout=max(0.0, settle_until - time.monotonic()))
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
        _echo_logs(logs)
        shutil.rmtree(folder, ignore_errors=True)
        del server
    return results
