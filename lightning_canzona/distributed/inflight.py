"""Asynchronous collectives whose tensors Python, not the backend's thread, frees.

gloo runs a collective on a worker thread of its own, which keeps the collective's tensors
until a moment after ``wait()`` has returned. A tensor that Python dropped meanwhile (a send
buffer that nothing else needs) is then freed by that thread, which must take the GIL to free
its Python object. When the interpreter has begun to shut down by then (a rank's run ends a few
milliseconds after its last optimizer step), Python ends that thread inside C++ and the rank
aborts ("terminate called without an active exception") after a successful run. `InFlight`
keeps a collective's tensors until the backend has let go of them, so that the last reference
to each is Python's, dropped on Python's own thread.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import Tensor

from lightning_canzona.compat import use_count

#: How long `InFlight.wait` waits for the backend to let go of the tensors. It takes
#: microseconds, or a scheduling quantum when the backend's thread is preempted.
PATIENCE_SECONDS = 10.0

#: Gives the CPU to another thread (the backend's, which needs no GIL for this) without
#: sleeping: a sleep of 0.1 ms on two loaded cores returned after milliseconds, 12 % of a step.
_yield_cpu = getattr(os, "sched_yield", lambda: time.sleep(0))


class InFlight:
    """An asynchronous collective, launched, and the tensors given to it.

    Args:
        collective: A ``torch.distributed`` collective, called with ``async_op=True``.
        *args: Its positional arguments; the tensors among them are the ones kept.
        **kwargs: Its keyword arguments (``group``, split sizes).
    """

    def __init__(self, collective: Callable[..., dist.Work], *args: Any, **kwargs: Any) -> None:
        # Only CPU collectives (gloo) free tensors on a thread of their own after completion;
        # NCCL's watchdog may keep them longer, and nothing needs to wait for it.
        self._tensors = [arg for arg in args if isinstance(arg, Tensor) and arg.device.type == "cpu"]
        # References before the launch (Python's): as torch.utils.swap_tensors, by _use_count.
        self._references = [use_count(tensor) for tensor in self._tensors]
        self._work: dist.Work | None = collective(*args, async_op=True, **kwargs)

    def wait(self) -> None:
        """Wait for the collective, then for the backend to drop its references to the tensors."""
        assert self._work is not None, "waited twice"
        self._work.wait()
        self._work = None  # the handle holds the tensors too
        deadline = time.monotonic() + PATIENCE_SECONDS
        while any(use_count(t) > n for t, n in zip(self._tensors, self._references)):
            if time.monotonic() > deadline:
                warnings.warn(
                    f"A collective's backend still held its tensors {PATIENCE_SECONDS:g} s after it "
                    "completed; if this process ends before the backend frees them, it may abort.",
                    RuntimeWarning,
                    stacklevel=2,
                )
                break
            _yield_cpu()
        self._tensors = []


def wait_for(collective: Callable[..., dist.Work], *args: Any, **kwargs: Any) -> None:
    """Run ``collective`` to completion, its tensors left to Python (`InFlight`): for the
    blocking collectives of a step, whose tensors Python may drop as soon as they return."""
    InFlight(collective, *args, **kwargs).wait()
