"""`InFlight`: the tensors of an asynchronous collective are freed by Python, not by gloo's thread."""

from __future__ import annotations

import threading
import warnings
import weakref

import torch
import torch.distributed as dist
from multiprocess import gloo_only, run_on_ranks

from lightning_canzona.distributed import agreement
from lightning_canzona.distributed.agreement import InFlight


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


@gloo_only("its worker thread frees CPU tensors")
def test_collective_tensors_are_freed_by_python_after_the_backend_lets_go() -> None:
    run_on_ranks(2, _free_after_wait)


def _warn_when_the_backend_keeps_a_tensor(rank: int, world_size: int) -> None:
    kept: list[torch.Tensor] = []

    def keeping_all_reduce(tensor: torch.Tensor, **kwargs) -> dist.Work:
        # A product that autograd will differentiate saves ``tensor``: a reference from C++ that
        # stays, as a backend's would that never let go.
        kept.append(torch.zeros(4, requires_grad=True) * tensor)
        return dist.all_reduce(tensor, **kwargs)

    agreement.PATIENCE_SECONDS = 0.2
    tensor = torch.ones(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        InFlight(keeping_all_reduce, tensor).wait()  # returns, after the patience, and says why
    assert len(caught) == 1 and str(caught[0].message).startswith(
        "A collective's backend still held its tensors 0.2 s after it completed"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        InFlight(dist.all_reduce, tensor).wait()  # the references held before it are not waited for
    assert not caught and tensor.equal(torch.full((4,), float(world_size**2)))


@gloo_only("InFlight waits for the CPU tensors that gloo's thread holds")
def test_a_tensor_the_backend_keeps_is_waited_for_only_so_long_and_said() -> None:
    run_on_ranks(2, _warn_when_the_backend_keeps_a_tensor)
