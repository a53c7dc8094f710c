"""The files of a checkpoint folder: where they are, meta.json, and their integrity.

    <root>/iter_0000100/        DCP data files, DCP's .metadata, meta.json
    <root>/latest_checkpointed_iteration.txt

meta.json lists every other file of the folder with its size and xxh3_64 digest (recorded while
the file was written, see parallel/checkpoint/checksums.py) and carries a digest of its own content,
so that a flipped byte anywhere is found on load: `check_files` compares sizes (always; a
stat per file) and digests (unless verification is turned off with --no-verify), and names
the first damaged or missing file.
"""

from __future__ import annotations

import json
import os
import shutil
import stat

from engine.errors import CheckpointError
from parallel.checkpoint.checksums import DIGEST, file_digest

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1 recorded no file checksums
LATEST = "latest_checkpointed_iteration.txt"
META = "meta.json"
_SELF_DIGEST = "meta_digest"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def is_iteration_name(name: str) -> bool:
    """iter_0000100, not the iter_0000100.tmp of a save that never committed."""
    return name.startswith("iter_") and name[len("iter_") :].isdigit()


def find_latest(root: str | None) -> int | None:
    """The newest committed iteration under root, or None when there is none."""
    if not root:
        return None
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        if os.path.isdir(root) and any(is_iteration_name(n) for n in os.listdir(root)):
            raise CheckpointError(
                f"{root} holds checkpoint folders but no {LATEST}; remove the incomplete ones "
                "or point --load at a complete checkpoint"
            )
        return None
    with open(path) as f:
        text = f.read().strip()
    try:
        iteration = int(text)
    except ValueError:
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}") from None
    if not os.path.isfile(os.path.join(iteration_dir(root, iteration), META)):
        raise CheckpointError(
            f"{path} names iteration {iteration}, but {iteration_dir(root, iteration)} is not a "
            "complete checkpoint"
        )
    return iteration


def _canonical(meta: dict) -> bytes:
    body = {k: v for k, v in meta.items() if k != _SELF_DIGEST}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def write_meta(folder: str, meta: dict) -> None:
    """Write meta.json (with its own digest) and sync it to disk."""
    import xxhash

    meta = dict(meta, format_version=FORMAT_VERSION)
    meta[_SELF_DIGEST] = xxhash.xxh3_64(_canonical(meta)).hexdigest()
    with open(os.path.join(folder, META), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_meta(path: str) -> dict:
    """meta.json of the checkpoint folder `path`, its own digest checked."""
    import xxhash

    meta_path = os.path.join(path, META)
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {META}; not a complete checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{meta_path}: damaged, not JSON ({err})") from None
    if not isinstance(meta, dict) or meta.get("format_version") not in READABLE_VERSIONS:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        raise CheckpointError(
            f"{path}: checkpoint format {version}, this engine reads "
            f"{', '.join(map(str, READABLE_VERSIONS))}"
        )
    recorded = meta.get(_SELF_DIGEST)
    if meta["format_version"] >= 2 and not (isinstance(recorded, str) and "files" in meta):
        raise CheckpointError(f"{meta_path}: damaged (its checksum or file list is missing)")
    if recorded is not None and xxhash.xxh3_64(_canonical(meta)).hexdigest() != recorded:
        raise CheckpointError(f"{meta_path}: damaged (its content does not match its checksum)")
    return meta


def _plain_name(name) -> bool:
    """A file directly inside the checkpoint folder: DCP's data files and its .metadata."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..", META)
        and "/" not in name
        and "\\" not in name
        and "\x00" not in name
        and (not name.startswith(".") or name == ".metadata")
    )


def file_problem(path: str, name: str, record, digest: bool) -> str | None:
    """What is wrong with file `name` of the checkpoint folder `path`, or None. Only plain
    files directly inside the folder are ever opened."""
    if not _plain_name(name) or not isinstance(record, dict):
        return f"{os.path.join(path, META)}: malformed entry {name!r} in its file list"
    if not isinstance(record.get("bytes"), int) or not isinstance(record.get(DIGEST), str):
        return f"{os.path.join(path, META)}: malformed entry {name!r} in its file list"
    where = os.path.join(path, name)
    try:
        info = os.lstat(where)
    except OSError:
        return f"{where}: missing (the checkpoint lists it); the checkpoint is incomplete"
    if not stat.S_ISREG(info.st_mode):
        return f"{where}: not a regular file; the checkpoint is damaged"
    if info.st_size != record["bytes"]:
        return (
            f"{where}: {info.st_size} bytes, but {record['bytes']} were written; the file is "
            "truncated or damaged"
        )
    if digest:
        try:
            matches = file_digest(where) == record[DIGEST]
        except OSError as err:
            return f"{where}: cannot be read ({err.strerror or err})"
        if not matches:
            return (
                f"{where}: checksum mismatch, the file is damaged; load an earlier checkpoint, "
                "or pass --no-verify to load it anyway"
            )
    return None


def check_files(path: str, meta: dict, digests: bool, part: tuple[int, int] = (0, 1)) -> str:
    """The first problem with the checkpoint's files, or "" when they are whole. Sizes are
    checked for every file; digests (when asked) only for this rank's share `part` = (rank,
    ranks) of them, so that several ranks read the checkpoint once between them."""
    files = meta.get("files")
    if files is None:  # format 1: nothing recorded to compare with
        return ""
    if not isinstance(files, dict) or ".metadata" not in files:
        return f"{os.path.join(path, META)}: malformed file list"
    names = sorted(files)
    for name in names:
        problem = file_problem(path, name, files[name], digest=False)
        if problem:
            return problem
    if digests:
        rank, ranks = part
        for name in names[rank::ranks]:
            problem = file_problem(path, name, files[name], digest=True)
            if problem:
                return problem
    return ""


def commit(tmp: str, root: str, iteration: int) -> None:
    """Rename a fully written iteration folder into place, then point the latest file at it
    (itself written under a temporary name and renamed)."""
    final = iteration_dir(root, iteration)
    if os.path.exists(final) and not os.path.isfile(os.path.join(final, META)):
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"{final} exists and is not a checkpoint of this engine (Megatron-LM's?); it is "
            "kept: save to another folder (--save) or at another iteration"
        )
    if os.path.exists(final):
        old = final + ".old"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    point_latest(root, iteration)


def committed_iterations(root: str) -> list[int]:
    """The iterations of the complete checkpoints under root, oldest first."""
    return sorted(
        int(n[5:])
        for n in os.listdir(root)
        if is_iteration_name(n) and os.path.isfile(os.path.join(root, n, META))
    )


def point_latest(root: str, iteration: int) -> None:
    """The latest file names `iteration` (written under a temporary name and renamed)."""
    latest_tmp = os.path.join(root, LATEST + ".tmp")
    with open(latest_tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest_tmp, os.path.join(root, LATEST))
