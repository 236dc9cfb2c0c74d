"""Count host syncs: every read of a tensor's value on the host, as a GPU would feel it.

`HostSyncs` is a ``TorchFunctionMode``: within it, every call of ``Tensor.item``, ``__bool__``,
``__int__``, ``__float__``, ``__index__``, ``tolist``, ``cpu``, ``numpy`` (a read of a tensor's
value on the host: on a GPU, a wait for the device) and every ``torch.tensor``/``torch.as_tensor``
of Python data (a copy from the host, which waits for the stream) is recorded with the line of
the package (or test) that made it. The mode sees all of them, factories included; it does not
see calls that torch makes inside another torch function (its handler runs with the mode off),
nor the index tensor that indexing by a Python list copies from the host, which it records
apart (`HostSyncs.list_indexing`).

On CPU ranks every tensor is a host tensor, so a count there is only the count a GPU would feel
when host-side counters are Python numbers, not tensors (as the package keeps them). ``canzona
doctor`` counts a step's with it on the device, ``tests/distributed/test_host_syncs.py`` each
optimizer's.
"""

from __future__ import annotations

import inspect
import os
from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

#: Tensor methods that read a value on the host.
READS = frozenset({"item", "__bool__", "__int__", "__float__", "__index__", "tolist", "cpu", "numpy"})
#: Factories that copy Python data into a tensor.
FACTORIES = frozenset({"tensor", "as_tensor"})

#: Where the package lies: places are given relative to the folder that holds it (its
#: repository, or site-packages).
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class HostSyncs(TorchFunctionMode):
    """Records the host syncs made within the block (see the module docstring).

    Attributes:
        where: ``"path:line (what)"`` of each sync, in order.
    """

    def __init__(self) -> None:
        super().__init__()
        self.where: list[str] = []
        #: ``"path:line"`` of each indexing by a Python list (an index tensor copied from the host
        #: inside ``__getitem__``/``__setitem__``, which no count of reads sees).
        self.list_indexing: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in READS or (name in FACTORIES and not (args and isinstance(args[0], torch.Tensor))):
            self.where.append(f"{_caller()} ({name})")
        elif name in ("__getitem__", "__setitem__") and len(args) > 1 and _has_list(args[1]):
            self.list_indexing.append(_caller())
        return func(*args, **(kwargs or {}))

    @property
    def count(self) -> int:
        """Syncs recorded."""
        return len(self.where)

    def summary(self) -> str:
        """Each place with how often it synced, most frequent first."""
        return "; ".join(f"{n}× {place}" for place, n in Counter(self.where).most_common()) or "none"


def _has_list(index: Any) -> bool:
    return isinstance(index, list) or (isinstance(index, tuple) and any(isinstance(i, list) for i in index))


def _caller() -> str:
    """The innermost frame under `_ROOT` outside this file and torch: the package's line, or a
    test's."""
    frame = inspect.currentframe()
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(_ROOT) and path != os.path.abspath(__file__) and "/torch/" not in path:
            return f"{os.path.relpath(path, _ROOT)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"
