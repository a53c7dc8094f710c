"""Run a function on N local gloo ranks: forked processes, a free port, one thread per rank,
a timeout, and the traceback of the first rank that fails. Used by the tests and the CPU
benchmarks; real jobs launch through torchrun (examples/pretrain_gpt.sh).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import socket
import time
import traceback

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(fn, rank, world_size, port, conn, threads, args, kwargs):
    status, payload = "error", None
    try:
        os.environ.update(
            OMP_NUM_THREADS=str(threads),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
        )
        torch.set_num_threads(threads)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=120),
        )
        payload = fn(rank, world_size, *args, **kwargs)
        status = "ok"
    except BaseException:  # noqa: BLE001 - every failure is reported to the parent
        payload = traceback.format_exc()
    try:
        conn.send_bytes(pickle.dumps((status, payload)))
    except Exception:  # noqa: BLE001 - an unpicklable result: report that instead
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    finally:
        conn.close()
        os._exit(0)  # skip the parent's atexit handlers in the forked child


def run_local(fn, world_size: int, *args, timeout: float = 240.0, threads: int = 1, **kwargs):
    """fn(rank, world_size, *args, **kwargs) on world_size forked gloo ranks; returns each
    rank's result, or raises AssertionError carrying the first failing rank's traceback."""
    context = multiprocessing.get_context("fork")
    port = free_port()
    pipes, processes = [], []
    for rank in range(world_size):
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(
            target=_entry,
            args=(fn, rank, world_size, port, sender, threads, args, kwargs),
            daemon=True,
        )
        process.start()
        sender.close()
        pipes.append(receiver)
        processes.append(process)
    results: list = [None] * world_size
    pending = set(range(world_size))
    deadline = time.monotonic() + timeout
    try:
        while pending:
            for rank in sorted(pending):
                if pipes[rank].poll(0.01):
                    try:
                        status, payload = pickle.loads(pipes[rank].recv_bytes())
                    except EOFError:
                        status, payload = "error", "the process died without reporting"
                    if status != "ok":
                        raise AssertionError(f"rank {rank} of {world_size} failed:\n{payload}")
                    results[rank] = payload
                    pending.discard(rank)
                elif not processes[rank].is_alive() and not pipes[rank].poll(0):
                    code = processes[rank].exitcode
                    raise AssertionError(f"rank {rank} of {world_size} died (exit code {code})")
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout:.0f}s; ranks {sorted(pending)} did not finish"
                )
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=5)
    return results
