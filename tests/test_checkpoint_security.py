"""Loading a checkpoint runs no code, whatever its files hold: hand-written pickles that reach
for dotted names, builtins, os, subprocess and nested reductions, DCP's own pickled byte
entries, and thousands of mutations of a real `.metadata`. Each is refused with one line, and a
marker file that the payloads would create never appears."""

from __future__ import annotations

import os
import pickle
import random
import shutil
import struct
import warnings

import pytest
import torch
import xxhash

from engine.checkpoint.files import iteration_dir, read_meta, write_meta
from engine.checkpoint.load import read_tensors
from engine.errors import CheckpointError
from parallel.checkpoint.metadata import load_metadata
from tests.cli import one_line_error, run_tool

# --- a tiny pickle assembler (protocol 4 opcodes) --------------------------------------------


def _str(text: str) -> bytes:
    data = text.encode()
    return (
        b"\x8c" + bytes([len(data)]) + data
        if len(data) < 256
        else b"X" + struct.pack("<I", len(data)) + data
    )


def _global(module: str, name: str) -> bytes:
    return _str(module) + _str(name) + b"\x93"  # STACK_GLOBAL


def _call(function: bytes, *args: bytes) -> bytes:
    return function + b"(" + b"".join(args) + b"tR"  # MARK args TUPLE REDUCE


def _list(*items: bytes) -> bytes:
    return b"](" + b"".join(items) + b"e"  # EMPTY_LIST MARK items APPENDS


def _pickle(body: bytes) -> bytes:
    return b"\x80\x04" + body + b"."


def _attacks(marker: str) -> dict[str, bytes]:
    touch = f"touch {marker}"
    python = f"__import__('os').system('{touch}')"
    os_module = _call(_global("builtins", "__import__"), _str("os"))
    getattr_system = _call(_global("builtins", "getattr"), os_module, _str("system"))
    metadata_class = _global("torch.distributed.checkpoint.metadata", "Metadata")
    return {
        "dotted name under an allowed module": _pickle(
            _call(_global("torch.distributed.checkpoint.filesystem", "os.system"), _str(touch))
        ),
        "dotted name on an allowed class": _pickle(
            _call(_global("torch.serialization", "_get_layout.__globals__"), _str("os"))
        ),
        "os.system": _pickle(_call(_global("os", "system"), _str(touch))),
        "posix.system": _pickle(_call(_global("posix", "system"), _str(touch))),
        "subprocess.check_call": _pickle(
            _call(_global("subprocess", "check_call"), _list(_str("touch"), _str(marker)))
        ),
        "builtins.eval": _pickle(_call(_global("builtins", "eval"), _str(python))),
        "builtins.exec": _pickle(_call(_global("builtins", "exec"), _str(python))),
        "builtins.getattr on __import__": _pickle(_call(getattr_system, _str(touch))),
        "protocol 0 GLOBAL": f"cos\nsystem\n(S'{touch}'\ntR.".encode(),
        "nested inside Metadata": _pickle(
            _call(metadata_class, _call(_global("os", "system"), _str(touch)))
        ),
        "pickled byte entry class": _pickle(
            _call(_global("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"))
        ),
    }


@pytest.mark.parametrize("name", sorted(_attacks("m")))
def test_hand_written_pickles_run_nothing(name, tmp_path):
    marker = str(tmp_path / "pwned")
    data = _attacks(marker)[name]
    with pytest.raises(CheckpointError) as info:
        load_metadata(data, "ckpt/.metadata")
    message = str(info.value)
    assert "\n" not in message and message.startswith("ckpt/.metadata: ")
    assert not os.path.exists(marker)


def _evil_object(marker: str):
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    return Evil()


def test_dcp_byte_entries_are_refused_not_unpickled(tmp_path, capfd):
    """DCP stores a non-tensor value as a pickled byte entry and loads it with full pickle;
    a checkpoint holding one must be refused before anything is unpickled."""
    import torch.distributed.checkpoint as dcp

    marker = str(tmp_path / "pwned")
    folder = str(tmp_path / "evil")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model/x": _evil_object(marker)}, checkpoint_id=folder, no_dist=True)
    with pytest.raises(CheckpointError) as info:
        read_tensors(folder, {"model/x": torch.empty(3)})
    assert str(info.value) == (
        f"{folder}/.metadata: refers to torch.distributed.checkpoint.metadata."
        "BytesStorageMetadata, which no checkpoint holds; refusing to load it (nothing was "
        "run). Only load checkpoints from sources you trust"
    )
    assert "Traceback" not in capfd.readouterr().err  # refused before DCP could retry
    assert not os.path.exists(marker)


def test_malformed_but_allowed_metadata_is_refused(small_checkpoint, tmp_path):
    """Allowed classes put together wrongly: a storage file outside the folder, a stream
    transform this engine never writes, an entry that is not a tensor."""
    path = os.path.join(iteration_dir(small_checkpoint, 2), ".metadata")
    with open(path, "rb") as f:
        original = load_metadata(f.read(), path)
    index, info = next(iter(original.storage_data.items()))
    cases = {
        "not a file of the checkpoint": lambda m: setattr(
            m.storage_data[index], "relative_path", "../../etc/passwd"
        ),
        "stream transforms": lambda m: setattr(
            m.storage_data[index], "transform_descriptors", ["zstd"]
        ),
        "not a tensor": lambda m: m.state_dict_metadata.__setitem__(index.fqn, 3),
        "chunk outside its size": lambda m: setattr(
            m.state_dict_metadata[index.fqn].chunks[0],
            "offsets",
            torch.Size([10**6] * len(m.state_dict_metadata[index.fqn].size)),
        ),
    }
    for expected, damage in cases.items():
        metadata = load_metadata(pickle.dumps(original), path)
        damage(metadata)
        with pytest.raises(CheckpointError, match=expected):
            load_metadata(pickle.dumps(metadata), path)


def _mutations(data: bytes, evil: list[bytes], rng: random.Random):
    """Random damage to a pickle: flipped bytes, cut or repeated ranges, truncation, and
    hostile snippets spliced in at random places."""
    size = len(data)
    for _ in range(3000):
        kind = rng.randrange(6)
        at = rng.randrange(size)
        if kind == 0:
            out = bytearray(data)
            for _ in range(rng.randint(1, 8)):
                out[rng.randrange(size)] = rng.randrange(256)
            yield bytes(out)
        elif kind == 1:
            yield data[:at] + data[at + rng.randint(1, 64) :]
        elif kind == 2:
            yield data[:at]
        elif kind == 3:
            yield (
                data[:at] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 16))) + data[at:]
            )
        elif kind == 4:
            yield data[:at] + rng.choice(evil) + data[at:]
        else:
            end = min(size, at + rng.randint(1, 256))
            yield data[:end] + data[at:]


def test_fuzzed_metadata_runs_nothing_and_fails_in_one_line(small_checkpoint, tmp_path):
    marker = str(tmp_path / "pwned")
    path = os.path.join(iteration_dir(small_checkpoint, 2), ".metadata")
    with open(path, "rb") as f:
        data = f.read()
    # The hostile snippets without their protocol header and STOP, to splice into a pickle.
    evil = [attack[2:-1] for attack in _attacks(marker).values() if attack.startswith(b"\x80")]
    outcomes = {"loaded": 0, "refused": 0}
    for mutated in _mutations(data, evil, random.Random(0)):
        try:
            load_metadata(mutated, path)
            outcomes["loaded"] += 1
        except CheckpointError as err:
            assert "\n" not in str(err)
            outcomes["refused"] += 1
        assert not os.path.exists(marker)
    assert outcomes["refused"] > 2000, outcomes


def test_cli_refuses_a_hostile_checkpoint_in_one_line(small_checkpoint, tmp_path):
    marker = str(tmp_path / "pwned")
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(small_checkpoint, ckpt)
    folder = iteration_dir(ckpt, 2)
    attack = _attacks(marker)["dotted name under an allowed module"]
    with open(os.path.join(folder, ".metadata"), "wb") as f:
        f.write(attack)
    # An attacker rewrites meta.json's record of the file too: the checksums guard against
    # damage, not against someone who can write the folder; the unpickler guards against them.
    meta = read_meta(folder)
    meta["files"][".metadata"] = {
        "bytes": len(attack),
        "xxh3_64": xxhash.xxh3_64(attack).hexdigest(),
    }
    write_meta(folder, meta)
    for extra in ([], ["--no-verify"]):
        output = str(tmp_path / "hf")
        line = one_line_error(
            run_tool("convert_checkpoint.py", "--load", ckpt, "--output", output, *extra)
        )
        assert not os.path.exists(marker)
    assert "refers to torch.distributed.checkpoint.filesystem.os.system" in line
    assert not os.path.exists(tmp_path / "hf")
