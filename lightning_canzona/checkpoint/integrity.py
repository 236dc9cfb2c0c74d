"""Every file of a checkpoint is what was saved, checked before anything is loaded from it.

- A **distributed checkpoint** (a folder) gets a manifest, ``manifest.json``, written last, once
  every rank's files are on disk: each file's size and CRC-32 (`write_manifest`). The ranks
  checksum the files in turns, each a share, and rank 0 writes the result.
- A **single file** needs none: torch saves it as a zip archive whose central directory, written
  last, holds every record's size and CRC-32.

`verify` checks either before a load, the ranks again sharing the files: a file missing, cut short
or changed — or any failure of a rank's share of the check — is found on the rank that read it
and is the same `CorruptCheckpointError` on every rank. CRC-32 is zlib's (3.7 GB/s on one core of
this project's CPU), the checksum of the zip format itself.
"""

from __future__ import annotations

import json
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_canzona.checkpoint.errors import corrupt, describe

#: The manifest of a distributed checkpoint.
MANIFEST = "manifest.json"
_CHUNK = 16 << 20


def write_manifest(folder: Path) -> str | None:
    """Write the manifest of the distributed checkpoint in ``folder`` (collective where a process
    group is initialized).

    Returns:
        What went wrong, or ``None``: a checksum's failure on any rank is returned on every rank,
        the manifest's own write (rank 0's) on rank 0 only.
    """
    rank, world = _ranks()
    names = (
        sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST) if rank == 0 else None
    )
    listing: list[Any] = [names]
    if world > 1:
        dist.broadcast_object_list(listing, src=0)  # the files as rank 0 sees them, on every rank
    entries, error = {}, None
    try:
        for name in listing[0][rank::world]:
            entries[name] = _entry(folder / name)
    except OSError as failure:
        error = f"rank {rank}: {failure}"
    everyone = _gathered((entries, error))
    errors = [error for _, error in everyone if error]
    if errors:
        return errors[0]
    if rank == 0:
        files = {name: entry for share, _ in everyone for name, entry in share.items()}
        manifest = {"format": "lightning_canzona checkpoint manifest", "version": 1, "files": files}
        try:
            (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        except OSError as failure:
            return f"rank 0: {failure}"
    return None


def verify(path: Path, collective: bool = True) -> bool:
    """Check every file of the checkpoint at ``path`` against its manifest or its zip directory
    (collective where a process group is initialized, unless ``collective`` is ``False``: each
    rank checks a share, every rank learns the result).

    Returns:
        ``True``; ``False`` for a distributed checkpoint without a manifest (saved by an earlier
        version or another strategy), which cannot be checked.

    Raises:
        CorruptCheckpointError: On every rank, naming the checkpoint and the files that differ
            from what was saved.
    """
    found = problems(path, collective)
    if found is None:
        return False
    if found:
        # Files whose checksums differ, or a manifest that cannot be used, still read unchecked.
        readable = all("CRC-32" in problem or MANIFEST in problem for problem in found)
        raise corrupt(path, found, readable)
    return True


def problems(path: Path, collective: bool = True) -> list[str] | None:
    """What differs from what was saved in the files of the checkpoint at ``path``, found on any
    rank (the same list on every rank; empty: it is whole), or ``None`` without a manifest;
    ``collective=False``: found by this process alone. Whatever this rank's share of the check
    raised is one of its findings: no rank may raise before the others hear of it."""
    rank, world = _ranks(collective)
    if path.is_dir() and not (path / MANIFEST).is_file():
        return None
    found: list[str] = []
    if path.is_dir():
        try:
            files = json.loads((path / MANIFEST).read_text())["files"]
            names = sorted(files)
        except Exception as error:
            files, names = {}, []
            if rank == 0:
                found.append(f"its {MANIFEST} cannot be read ({describe(error)})")
        for name in names[rank::world]:
            try:
                found += _check(path / name, files[name])
            except Exception as error:  # an entry of a damaged manifest that parsed
                found.append(f"{name} cannot be checked against its {MANIFEST} entry ({describe(error)})")
    elif rank == 0:
        found += _check_archive(path)
    return [problem for share in _gathered(found, collective) for problem in share]


def _ranks(collective: bool = True) -> tuple[int, int]:
    """This process's rank and the number of ranks (one process without a process group, or
    where it works alone)."""
    return (dist.get_rank(), dist.get_world_size()) if collective and dist.is_initialized() else (0, 1)


def _gathered(value: Any, collective: bool = True) -> list[Any]:
    """``value`` of every rank, in rank order (of this one alone, unless collective)."""
    if not (collective and dist.is_initialized()):
        return [value]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone


def _entry(path: Path) -> dict[str, Any]:
    crc = 0
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return {"size": path.stat().st_size, "crc32": f"{crc:08x}"}


def _check(path: Path, expected: dict[str, Any]) -> list[str]:
    if not path.is_file():
        return [f"{path.name} is missing"]
    size = path.stat().st_size
    if size != expected["size"]:
        return [f"{path.name} has {size} bytes, {expected['size']} when saved"]
    found = _entry(path)["crc32"]
    if found != expected["crc32"]:
        return [f"{path.name} has CRC-32 {found}, {expected['crc32']} when saved"]
    return []


def _check_archive(path: Path) -> list[str]:
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except FileNotFoundError:
        return [f"{path.name} is missing"]
    except zipfile.BadZipFile as error:
        return [f"{path.name} is not a whole zip archive, as torch saves one ({error})"]
    except Exception as error:  # a damaged header: a name that is not UTF-8, an offset past the end…
        return [f"{path.name} is not a whole zip archive, as torch saves one ({describe(error)})"]
    return [] if bad is None else [f"the record {bad} of {path.name} has another CRC-32 than when saved"]
