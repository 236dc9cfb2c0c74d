"""`InFlight`: the tensors of an asynchronous collective are freed by Python, not by gloo's thread."""

from __future__ import annotations

import threading
import weakref

import torch
import torch.distributed as dist
from multiprocess import run_on_ranks

from lightning_canzona.distributed.inflight import InFlight


def _free_after_wait(rank: int, world_size: int) -> None:
    on_main_thread: list[bool] = []
    for size in range(1, 201):
        send = torch.full((size * world_size,), float(rank))
        receive = torch.empty(size * world_size)
        weakref.finalize(
            send, lambda: on_main_thread.append(threading.current_thread() is threading.main_thread())
        )
        collective = InFlight(dist.all_to_all_single, receive, send)
        del send  # as a send buffer goes: nothing but the collective needs it
        collective.wait()
        assert receive.view(world_size, size).equal(
            torch.arange(world_size).float()[:, None].expand(-1, size)
        )
    # A send buffer that gloo's thread freed would have run its finalizer there: at interpreter
    # shutdown, that thread would abort the process.
    assert on_main_thread == [True] * 200


def test_collective_tensors_are_freed_by_python_after_the_backend_lets_go() -> None:
    run_on_ranks(2, _free_after_wait)
