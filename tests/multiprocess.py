"""Run a test body on several gloo ranks (CPU processes, one thread each)."""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(
    rank: int, world_size: int, store_path: str, timeout: float, body: Callable[..., Any], args: tuple
) -> None:
    torch.set_num_threads(1)
    # A file store, not a TCP port: a free port picked here can be taken by another process
    # (CI downloads while the suite runs) before rank 0 binds it.
    store = dist.FileStore(store_path, world_size)
    # A rank that skips a collective makes the others time out instead of hanging the suite.
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
    )
    try:
        body(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    # A spawned process ends with the interpreter's teardown, where a gloo thread still freeing a
    # tensor aborts a rank that passed ("terminate called without an active exception"). The
    # package's collectives cannot (`lightning_canzona.distributed.inflight`); test bodies' own
    # may. A failure (above) still reaches torch's error file; a success ends here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_ranks(world_size: int, body: Callable[..., Any], *args: Any, timeout: float = 120.0) -> None:
    """Run ``body(rank, world_size, *args)`` on ``world_size`` processes; re-raise any failure.

    ``timeout`` (seconds) bounds every collective: a test of a failure that could hang sets it
    short, so that a hang fails the test in seconds.
    """
    with tempfile.TemporaryDirectory() as directory:
        store_path = str(Path(directory) / "store")
        args = (world_size, store_path, timeout, body, args)
        mp.start_processes(_worker, args=args, nprocs=world_size, join=True, start_method="forkserver")


# Ranks fork from one server process that imported torch and the package once (about 8 s of
# imports per rank otherwise, most of it Lightning's); the server runs no OpenMP region, so its
# forks cannot inherit OpenMP threads.
multiprocessing.set_forkserver_preload(["torch", "lightning_canzona"])
