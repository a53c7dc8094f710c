"""Writing a checkpoint of ours converted from another format (Hugging Face, Megatron-LM).

The model tensors are given as LazyTensors, each read from the source only when the writer
reaches it, so peak memory stays near the largest tensor. The folder is written under a
temporary name and renamed into place at the end; an existing, non-empty one is never
overwritten, and a failure leaves nothing behind.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable

from engine.checkpoint.files import commit, iteration_dir, write_meta
from engine.errors import InputError, UserError
from parallel.checkpoint.checksums import ChecksummingWriter
from parallel.checkpoint.dcp import BoxSavePlanner
from parallel.errors import describe_os_error, root_cause


def check_new_output(output: str) -> str:
    """The absolute path of `output`, which must not exist yet or be an empty folder."""
    output = os.path.abspath(output)
    if os.path.exists(output) and not (os.path.isdir(output) and not os.listdir(output)):
        raise InputError(
            f"--output {output} already exists and is not empty; give a new folder (an "
            "existing checkpoint is never overwritten)"
        )
    return output


def write_converted(
    output: str,
    iteration: int,
    state: dict,
    make_meta: Callable[[dict], dict],
    before_meta: Callable[[str], None] | None = None,
) -> str:
    """Write `state` as iteration `iteration` of the checkpoint folder `output` (with the
    latest file); make_meta(files) gives meta.json from the written files' record;
    before_meta(staging) may add files to the folder first. Returns the iteration folder."""
    import torch.distributed.checkpoint as dcp

    output = check_new_output(output)
    staging = f"{output}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        os.makedirs(staging)
        folder = iteration_dir(staging, iteration) + ".tmp"
        writer = ChecksummingWriter(folder)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is not initialized": on purpose
            dcp.save(state, storage_writer=writer, planner=BoxSavePlanner(), no_dist=True)
        if before_meta is not None:
            before_meta(staging)
        write_meta(folder, make_meta(writer.files))
        commit(folder, staging, iteration)  # writes the latest file
        if os.path.isdir(output):
            os.rmdir(output)  # empty, checked above
        os.replace(staging, output)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        cause = root_cause(err)  # DCP wraps what went wrong in its own exception
        if isinstance(cause, UserError):
            raise cause from None
        if isinstance(cause, OSError):
            raise InputError(describe_os_error(cause, cause.filename or output)) from None
        raise
    return iteration_dir(output, iteration)
