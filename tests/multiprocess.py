"""Run a test body on several ranks: CPU processes over gloo (one thread each), or with
``CANZONA_TEST_DEVICE=cuda`` one GPU a rank over NCCL.

Test bodies put their tensors, meshes and one-process references on `DEVICE` (``"cpu"`` or
``"cuda"``: each rank's current CUDA device is its own). A test that needs more GPUs than the
machine has is skipped, saying so.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_canzona.tools.checks import gpu_shortage

#: Where the ranks compute: ``cpu`` (gloo) or ``cuda`` (NCCL, one GPU a rank).
DEVICE = os.environ.get("CANZONA_TEST_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"CANZONA_TEST_DEVICE must be 'cpu' or 'cuda', got {DEVICE!r}")
#: The process group's backend on `DEVICE`.
BACKEND = {"cpu": "gloo", "cuda": "nccl"}[DEVICE]


def gloo_only(reason: str) -> pytest.MarkDecorator:
    """Skip a test of gloo's own behaviour when the ranks run on GPUs (``reason``: what it tests)."""
    return pytest.mark.skipif(BACKEND != "gloo", reason=f"gloo only: {reason}")


def _worker(
    rank: int,
    world_size: int,
    store_path: str,
    timeout: float,
    nccl_like: bool,
    body: Callable[..., Any],
    args: tuple,
) -> None:
    torch.set_num_threads(1)
    # A file store, not a TCP port: a free port picked here can be taken by another process
    # (CI downloads while the suite runs) before rank 0 binds it.
    store = dist.FileStore(store_path, world_size)
    device_id = None
    if DEVICE == "cuda":
        device_id = torch.device("cuda", rank)
        torch.cuda.set_device(device_id)  # object collectives and barriers use the current device
    # A rank that skips a collective makes the others time out instead of hanging the suite.
    dist.init_process_group(
        BACKEND,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
        device_id=device_id,
    )
    try:
        if nccl_like:
            from emulated_nccl import nccl_like as emulated

            with emulated(emulate=DEVICE == "cpu"):
                body(rank, world_size, *args)
        else:
            body(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    # A spawned process ends with the interpreter's teardown, where a gloo thread still freeing a
    # tensor aborts a rank that passed ("terminate called without an active exception"). The
    # package's collectives cannot (`lightning_canzona.distributed.agreement.InFlight`); test bodies' own
    # may. A failure (above) still reaches torch's error file; a success ends here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_ranks(
    world_size: int, body: Callable[..., Any], *args: Any, timeout: float = 120.0, nccl_like: bool = False
) -> None:
    """Run ``body(rank, world_size, *args)`` on ``world_size`` processes; re-raise any failure.

    ``timeout`` (seconds) bounds every collective: a test of a failure that could hang sets it
    short, so that a hang fails the test in seconds. ``nccl_like``: on CPU ranks, the process
    group refuses what NCCL would (`emulated_nccl.nccl_like`); on GPUs, where it is NCCL, its
    tensor collectives are recorded alike.
    """
    shortage = gpu_shortage(world_size) if DEVICE == "cuda" else None
    if shortage:
        pytest.skip(f"CANZONA_TEST_DEVICE=cuda: this test {shortage}")
    with tempfile.TemporaryDirectory() as directory:
        store_path = str(Path(directory) / "store")
        args = (world_size, store_path, timeout, nccl_like, body, args)
        mp.start_processes(_worker, args=args, nprocs=world_size, join=True, start_method="forkserver")


# Ranks fork from one server process that imported torch and the package once (about 8 s of
# imports per rank otherwise, most of it Lightning's); the server runs no OpenMP region, so its
# forks cannot inherit OpenMP threads. It never touches CUDA, so its forks may.
multiprocessing.set_forkserver_preload(["torch", "lightning_canzona"])
