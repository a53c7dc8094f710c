"""--async-save blocks training only while the copy of the state is unfinished: save() returns
at once, the next optimizer update waits for the copy (and only for it: not for the write to
disk), and the checkpoint holds the state of the iteration it names, not a later one.

The copy and the write are held back by gates (events the test opens), so the order of events
is forced rather than timed."""

from __future__ import annotations

import threading

import torch

from tests.distributed import run_ranks

GATE_TIMEOUT_S = 60.0


def _gated_async_save(rank, world, folder):
    from engine.checkpoint.files import iteration_dir
    from engine.checkpoint.load import load_model_weights
    from engine.checkpoint.save import Checkpointer
    from engine.checkpoint.staging import HostStaging
    from engine.model.builder import build_model_chunks
    from engine.pretrain import parse
    from engine.train.checkpoint import save
    from engine.train.iteration import train_iteration
    from engine.train.preflight import prepare
    from engine.train.setup import setup
    from parallel.state import ParallelState

    copy_gate, write_gate = threading.Event(), threading.Event()
    copy_started, copy_done = threading.Event(), threading.Event()
    real_copy, real_write = HostStaging.copy_from, Checkpointer._write

    def gated_copy(self, state, ready):
        copy_started.set()
        assert copy_gate.wait(GATE_TIMEOUT_S), "the copy's gate was never opened"
        staged = real_copy(self, state, ready)
        copy_done.set()
        return staged

    def gated_write(self, *args, **kwargs):
        assert write_gate.wait(GATE_TIMEOUT_S), "the write's gate was never opened"
        return real_write(self, *args, **kwargs)

    HostStaging.copy_from, Checkpointer._write = gated_copy, gated_write
    argv = [
        "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--train-iters", "4", "--mock-data", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "64", "--lr", "1e-2", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--num-workers", "0",
        "--save", folder, "--save-interval", "1000", "--async-save",
    ]  # fmt: skip
    cfg = prepare(parse(argv), world)
    state = ParallelState.build(1, 1)
    run = setup(cfg, state)
    model = run.chunks[0].module
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = [{"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}]

    def params():
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    def step_in_thread():
        thread = threading.Thread(target=train_iteration, args=(run, batch), daemon=True)
        thread.start()
        return thread

    # when the step reaches the update's wait for the copy, and when the update itself runs
    waiting, updated = threading.Event(), threading.Event()
    wait_for_copy, optimizer_step = run.checkpointer.wait_for_copy, run.optimizer.step

    def noting_the_wait():
        waiting.set()
        wait_for_copy()

    def noting_the_update(*args, **kwargs):
        updated.set()
        return optimizer_step(*args, **kwargs)

    run.checkpointer.wait_for_copy, run.optimizer.step = noting_the_wait, noting_the_update
    seen = {}
    train_iteration(run, batch)
    run.progress.counters.iteration = 1
    saved = params()
    waiting.clear()
    updated.clear()
    save(run)  # returns with the copy still held back
    seen["save_returned_before_the_copy"] = not copy_done.is_set()
    assert copy_started.wait(GATE_TIMEOUT_S)
    step = step_in_thread()
    assert waiting.wait(GATE_TIMEOUT_S)  # forward and backward done: at the update
    step.join(1.0)  # an update that did not wait would run within microseconds of this
    seen["update_waits_for_the_copy"] = not updated.is_set() and step.is_alive()
    seen["weights_kept_while_waiting"] = all(torch.equal(p, saved[n]) for n, p in params().items())
    copy_gate.set()
    step.join(GATE_TIMEOUT_S)
    seen["update_ran_once_copied"] = not step.is_alive()
    seen["weights_moved"] = any(not torch.equal(p, saved[n]) for n, p in params().items())
    # the copy is done, the write is still held back: the next step does not wait for it
    step = step_in_thread()
    step.join(GATE_TIMEOUT_S)
    seen["next_step_ran_while_writing"] = not step.is_alive() and not write_gate.is_set()
    write_gate.set()
    run.checkpointer.wait()
    fresh = build_model_chunks(cfg.model, state)[0]
    load_model_weights(iteration_dir(folder, 1), fresh)
    seen["checkpoint_holds_iteration_1"] = all(
        torch.equal(p, saved[n]) for n, p in fresh.named_parameters()
    )
    return seen


def test_async_save_blocks_only_until_the_copy_is_done(tmp_path):
    [seen] = run_ranks(_gated_async_save, 1, str(tmp_path / "ckpt"))
    assert seen == {
        "save_returned_before_the_copy": True,
        "update_waits_for_the_copy": True,
        "weights_kept_while_waiting": True,
        "update_ran_once_copied": True,
        "weights_moved": True,
        "next_step_ran_while_writing": True,
        "checkpoint_holds_iteration_1": True,
    }
