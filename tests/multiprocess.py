"""Run a test body on several gloo ranks (CPU processes, one thread each)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    rank: int, world_size: int, port: int, timeout: float, body: Callable[..., Any], args: tuple
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # A rank that skips a collective makes the others time out instead of hanging the suite.
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout))
    try:
        body(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_on_ranks(world_size: int, body: Callable[..., Any], *args: Any, timeout: float = 120.0) -> None:
    """Run ``body(rank, world_size, *args)`` on ``world_size`` processes; re-raise any failure.

    ``timeout`` (seconds) bounds every collective: a test of a failure that could hang sets it
    short, so that a hang fails the test in seconds.
    """
    mp.spawn(_worker, args=(world_size, _free_port(), timeout, body, args), nprocs=world_size, join=True)
