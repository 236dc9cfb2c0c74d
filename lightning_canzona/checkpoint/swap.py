"""Putting a fully written checkpoint in place of the previous one, crash-atomically.

A save writes beside the checkpoint it replaces (`staging_path`) and swaps the new one in once
every rank has written its part (`replace_with`), so a save that dies midway never costs the
last good checkpoint. The swap itself:

- a **file** replaces a file with one ``rename``, atomic everywhere;
- a **folder** (a distributed checkpoint) cannot replace a non-empty folder with a rename. Where
  the kernel can exchange two paths atomically (Linux ``renameat2(RENAME_EXCHANGE)``, macOS
  ``renamex_np(RENAME_SWAP)``), the new folder and the old trade places in one step and the old
  one, now under the staging name, is deleted after: at every moment the name holds one complete
  checkpoint. Elsewhere (other systems, file systems that refuse the exchange) the old folder is
  moved aside first (`previous_path`), the new one moved in, the old one deleted: a crash between
  the two moves leaves the name empty and the previous checkpoint beside it, which `recover`
  puts back when the checkpoint is next loaded or looked for.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import shutil
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def staging_path(path: Path) -> Path:
    """Where a checkpoint for ``path`` is written before it replaces ``path``."""
    return path.with_name(f".{path.name}.partial")


def previous_path(path: Path) -> Path:
    """Where a swap without an atomic exchange keeps the previous checkpoint while it moves the new
    one in (see the module docstring)."""
    return path.with_name(f".{path.name}.old")


def remove(path: Path) -> None:
    """Delete a checkpoint file or folder, if there is one."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def replace_with(staged: Path, path: Path) -> None:
    """Put the fully written ``staged`` checkpoint at ``path`` (see the module docstring)."""
    if not (path.exists() or path.is_symlink()) or (staged.is_file() and not path.is_dir()):
        os.replace(staged, path)
        return
    if exchange(staged, path):
        remove(staged)  # the previous checkpoint, now under the staging name
        return
    previous = previous_path(path)
    remove(previous)
    os.replace(path, previous)
    os.replace(staged, path)
    remove(previous)


def recover(path: Path) -> bool:
    """Put back the checkpoint that an interrupted swap left beside ``path``, if ``path`` is gone,
    and remove the partial checkpoint of that save; remove it if ``path`` is there (the swap had
    moved the new one in). Returns whether it put one back.

    Processes that call it together (every rank under ``torchrun``) put it back once.
    """
    previous = previous_path(path)
    if path.exists() or path.is_symlink():
        # Killed after the new checkpoint moved in, before the old one was deleted.
        shutil.rmtree(previous, ignore_errors=True)
        return False
    if not previous.exists():
        return False
    try:
        os.replace(previous, path)
    except FileNotFoundError:  # another process (a rank under torchrun) put it back first
        return path.exists()
    shutil.rmtree(staging_path(path), ignore_errors=True)
    log.warning(
        "lightning_canzona: recovered the checkpoint %s from %s, where a save that was interrupted "
        "while swapping in its successor had left it.",
        path,
        previous.name,
    )
    return True


def exchange(first: Path, second: Path) -> bool:
    """Exchange two existing paths atomically; ``False`` where the system or file system cannot."""
    try:
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None, use_errno=True)
            function, flag = libc.renameat2, 2  # RENAME_EXCHANGE
            function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            at_cwd = -100  # AT_FDCWD: paths relative to the working directory, as given
            result = function(at_cwd, os.fsencode(first), at_cwd, os.fsencode(second), flag)
        elif sys.platform == "darwin":
            libc = ctypes.CDLL(None, use_errno=True)
            function, flag = libc.renamex_np, 2  # RENAME_SWAP
            function.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint]
            result = function(os.fsencode(first), os.fsencode(second), flag)
        else:
            return False
    except AttributeError:  # a C library without the call
        return False
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False  # this file system cannot: fall back to two renames
    raise OSError(code, f"exchanging {first} and {second}: {os.strerror(code)}")
