"""How much memory the optimizer step's own buffers hold at once.

The engine allocates transient buffers each step: prepared shards, all-to-all send and receive
buffers, assembled full matrices, directions. `BufferMeter` counts every such tensor from its
creation until Python frees it (a ``weakref.finalize``), so the peak it reports is what the step
really held at once, whatever the device (no allocator statistics needed, so it is measured the
same way on CPU and GPU).

A buffer given to an asynchronous collective is kept until the backend has let go of it
(`lightning_canzona.distributed.inflight`), so it is freed on the step's own thread; the counts
are kept under a lock all the same (reentrant: a garbage collection inside `track` may free a
tracked tensor).
"""

from __future__ import annotations

import threading
import weakref

from torch import Tensor


class BufferMeter:
    """Live and peak bytes of the tensors given to `track`.

    Attributes:
        live: Bytes of tracked tensors not yet freed.
        peak: Largest ``live`` since the last `restart`.
        total: Bytes tracked since the last `restart`.
    """

    def __init__(self) -> None:
        self.live = self.peak = self.total = 0
        self._lock = threading.RLock()

    def restart(self) -> None:
        """Start a new measurement (tensors still alive keep counting)."""
        with self._lock:
            self.peak, self.total = self.live, 0

    def track(self, tensor: Tensor) -> Tensor:
        """Count ``tensor`` until it is freed; returns it."""
        size = tensor.numel() * tensor.element_size()
        with self._lock:
            self.live += size
            self.total += size
            self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._release, size)
        return tensor

    def _release(self, size: int) -> None:
        with self._lock:
            self.live -= size
