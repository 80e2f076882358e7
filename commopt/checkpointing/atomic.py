"""Checkpoint directories that cannot lie: staged, checksummed, renamed into place.

A checkpoint is a directory of *parts* (``replicated``, ``rank0``, ``rank1``, ...), each a
folder of files one rank writes. :func:`save_parts` writes every part under a staging name
beside the checkpoint (``.NAME.partial``), each rank its own parts; every file and folder is
fsynced, and each rank sends the size and SHA-256 of its files to rank 0 through the
communicator. Once every rank's part is on disk, rank 0 writes ``MANIFEST.json`` (the parts,
their files, sizes and checksums, the number of ranks) and renames the staging directory
into place. Replacing an existing checkpoint takes two renames: the old one moves aside to
``.NAME.old``, the new one moves in, then the old one is removed. A process killed at any
moment leaves the previous checkpoint loadable: under its name, or (between the two renames)
under ``.NAME.old``, where :func:`resolve` finds it.

Loading checks each file it reads against the manifest (:func:`verify_part`): a missing,
truncated or altered file raises :class:`CheckpointError` naming the file and what is
wrong, before anything is restored.

    >>> import tempfile, commopt
    >>> comm = commopt.create_communicator("local")
    >>> final = Path(tempfile.mkdtemp()) / "ckpt"
    >>> def write(staging):
    ...     (staging / "rank0").mkdir()
    ...     (staging / "rank0" / "data.bin").write_bytes(b"0123")
    ...     return ["rank0"]
    >>> save_parts(final, comm, write)
    >>> manifest = read_manifest(final)
    >>> manifest["world_size"], manifest["parts"]["rank0"]["data.bin"]["bytes"]
    (1, 4)
    >>> (final / "rank0" / "data.bin").write_bytes(b"01")
    2
    >>> verify_part(final, manifest, "rank0")
    Traceback (most recent call last):
    ...
    commopt.checkpointing.atomic.CheckpointError: .../rank0/data.bin is truncated: 2 bytes on disk, the manifest says 4; ...
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "aside_path",
    "fsync_dir",
    "read_manifest",
    "resolve",
    "save_parts",
    "staging_path",
    "verify_part",
    "write_text_atomic",
]

MANIFEST = "MANIFEST.json"
FORMAT = "commopt-checkpoint"
VERSION = 1
_CHUNK = 1 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted (missing, truncated or altered files), or a save
    that did not complete. The message names the file and what is wrong."""


# -- the file system -------------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (files created, renamed or removed in it) durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a platform where directories cannot be opened: nothing to do
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # file systems that do not sync directories (some network ones)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary name beside ``path``, fsync, then rename over ``path``."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _digest(path: Path, *, sync: bool = False) -> dict[str, Any]:
    """Size and SHA-256 of ``path`` (``sync``: fsync it too, so what is hashed is on disk)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
        if sync:
            os.fsync(f.fileno())
    return {"bytes": size, "sha256": h.hexdigest()}


def _describe_part(part: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {bytes, sha256}}`` of every file in ``part``; syncs files and folders."""
    files: dict[str, dict[str, Any]] = {}
    for folder, dirs, names in os.walk(part):
        dirs.sort()
        for name in sorted(names):
            p = Path(folder) / name
            files[p.relative_to(part).as_posix()] = _digest(p, sync=True)
        fsync_dir(Path(folder))
    return files


def staging_path(final: Path) -> Path:
    """Where a save writes before the rename (a hidden sibling of ``final``)."""
    return final.with_name(f".{final.name}.partial")


def aside_path(final: Path) -> Path:
    """Where the previous checkpoint waits while a new one replaces it."""
    return final.with_name(f".{final.name}.old")


def _is_checkpoint(path: Path) -> bool:
    """A committed checkpoint (a manifest), or one written before manifests existed."""
    return (path / MANIFEST).is_file() or (path / "replicated").is_dir()


def resolve(final: Path) -> Path | None:
    """The directory holding the checkpoint saved as ``final``, or None when there is none.

    ``final`` itself, or its aside copy when a save was killed between the two renames that
    replace a checkpoint.
    """
    if final.is_dir() and _is_checkpoint(final):
        return final
    aside = aside_path(final)
    if not final.exists() and (aside / MANIFEST).is_file():
        return aside
    return None


# -- saving ----------------------------------------------------------------------------------


def save_parts(
    final: str | os.PathLike,
    comm,
    write: Callable[[Path], list[str]],
    *,
    meta: dict[str, Any] | None = None,
) -> None:
    """Write a checkpoint at ``final`` atomically; a collective call (every rank calls it).

    ``write(staging)`` writes this rank's parts as folders under ``staging`` and returns
    their names. Returns on every rank once the checkpoint is complete and renamed into
    place; raises :class:`CheckpointError` on every rank when any rank failed (the
    previous checkpoint at ``final`` is then untouched). ``final`` must be on a file system
    every rank shares. ``meta`` (JSON values) is recorded in the manifest.
    """
    final = Path(final).absolute()
    staging = staging_path(final)
    error = None
    if comm.rank == 0:
        error = _catch(lambda: _prepare(final, staging))
    _raise_any(comm.allgather_obj(error), "preparing", final)

    def own_parts() -> dict[str, Any]:
        names = write(staging)
        parts = {}
        for name in names:
            part = staging / name
            if not part.is_dir():
                raise CheckpointError(f"rank {comm.rank}: part {name!r} was not written")
            parts[name] = _describe_part(part)
        fsync_dir(staging)
        return parts

    report: dict[str, Any] = {}
    error = _catch(lambda: report.update(own_parts()))
    reports = comm.allgather_obj({"error": error, "parts": report})
    _raise_any([r["error"] for r in reports], "writing", final)
    if comm.rank == 0:
        error = _catch(lambda: _commit(final, staging, comm.size, reports, meta or {}))
    error = comm.bcast_obj(error, root=0)
    if error is not None:
        raise CheckpointError(f"saving {final}: rank 0: {error}")


def _catch(fn: Callable[[], Any]) -> str | None:
    try:
        fn()
    except Exception as exc:  # reported to every rank, which all raise it
        return f"{type(exc).__name__}: {exc}"
    return None


def _raise_any(errors: list[str | None], what: str, final: Path) -> None:
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if failed:
        raise CheckpointError(
            f"saving {final} failed while {what} ({'; '.join(failed)}); the previous "
            "checkpoint there, if any, is untouched"
        )


def _prepare(final: Path, staging: Path) -> None:
    if final.exists() and not (final.is_dir() and _is_checkpoint(final)):
        raise CheckpointError(
            f"{final} exists and is not a commopt checkpoint: save to a new path (a "
            "checkpoint replaces what is at its path)"
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    if staging.exists():  # left by a save that was killed: never part of a checkpoint
        shutil.rmtree(staging)
    staging.mkdir()
    fsync_dir(final.parent)


def _commit(
    final: Path, staging: Path, size: int, reports: list[dict], meta: dict[str, Any]
) -> None:
    parts: dict[str, Any] = {}
    for rank, report in enumerate(reports):
        for name, files in report["parts"].items():
            if name in parts:
                raise CheckpointError(f"part {name!r} was written by two ranks")
            if not (staging / name).is_dir():
                raise CheckpointError(
                    f"rank 0 does not see rank {rank}'s part {staging / name}: the checkpoint "
                    "path must be on a file system every rank shares"
                )
            parts[name] = files
    body = {
        "format": FORMAT,
        "version": VERSION,
        "world_size": size,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "meta": meta,
        "parts": parts,
    }
    body["checksum"] = _body_checksum(body)
    write_text_atomic(staging / MANIFEST, json.dumps(body, indent=1, sort_keys=True) + "\n")
    aside = aside_path(final)
    if final.exists():
        if aside.exists():  # an earlier replacement's leftover: final is complete
            shutil.rmtree(aside)
        os.rename(final, aside)
        fsync_dir(final.parent)
    os.rename(staging, final)
    fsync_dir(final.parent)
    if aside.exists():
        shutil.rmtree(aside)


def _body_checksum(body: dict[str, Any]) -> str:
    rest = {k: v for k, v in body.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


# -- loading ---------------------------------------------------------------------------------


def read_manifest(directory: Path) -> dict[str, Any]:
    """The checked manifest of a committed checkpoint directory."""
    path = Path(directory) / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is missing: {directory} is not a complete commopt checkpoint"
        ) from None
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON (corrupted or truncated): {exc}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a commopt checkpoint manifest")
    if body.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: manifest version {body.get('version')!r}, this commopt reads {VERSION}: "
            "upgrade commopt"
        )
    if body.get("checksum") != _body_checksum(body):
        raise CheckpointError(f"{path} is corrupted: its checksum does not match its content")
    if not isinstance(body.get("parts"), dict) or not isinstance(body.get("world_size"), int):
        raise CheckpointError(f"{path} lacks its parts or world_size")
    return body


def verify_part(directory: Path, manifest: dict[str, Any], part: str) -> Path:
    """Check every file of ``part`` against the manifest; return the part's folder."""
    directory = Path(directory)
    files = manifest["parts"].get(part)
    if files is None:
        raise CheckpointError(
            f"{directory} has no part {part!r} (its parts: {', '.join(sorted(manifest['parts']))})"
        )
    root = directory / part
    hint = "the checkpoint is damaged: load an earlier one"
    for rel, want in sorted(files.items()):
        rp = PurePosixPath(rel)
        if rp.is_absolute() or ".." in rp.parts:
            raise CheckpointError(f"{directory / MANIFEST} names a file outside {root}: {rel!r}")
        path = root / rp
        try:
            have = _digest(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing; {hint}") from None
        if have["bytes"] != want["bytes"]:
            how = "truncated" if have["bytes"] < want["bytes"] else "longer than written"
            raise CheckpointError(
                f"{path} is {how}: {have['bytes']} bytes on disk, the manifest says "
                f"{want['bytes']}; {hint}"
            )
        if have["sha256"] != want["sha256"]:
            raise CheckpointError(
                f"{path} is corrupted: its SHA-256 is {have['sha256'][:16]}..., the manifest "
                f"says {want['sha256'][:16]}...; {hint}"
            )
    return root
