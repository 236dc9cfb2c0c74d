"""The checks that ``canzona doctor`` runs and the tests make too, in one place: both call these.

- `HostSyncs` counts the reads of a device value on the host that a block makes, as a GPU would
  feel them; a step may make `HOST_SYNCS_PER_STEP` (the doctor's "host syncs of a step",
  ``tests/distributed/test_host_syncs.py``).
- `gpu_shortage` says when ranks outnumber the visible GPUs (``canzona bench --device cuda``
  refuses to start them; ``tests/multiprocess.py`` skips such a test).
- `RecordLosses` records a Trainer run's losses, and `RESUME_TOLERANCE` is how far a resumed
  run's may lie from the uninterrupted run's (the doctor's "Trainer checkpoint resume",
  ``tests/integration/test_checkpoints.py``).
- `take_steps` runs an optimizer on one matrix over given gradients (the doctor's comparisons
  of Muon with ``torch.optim.Muon`` and of Shampoo and SOAP with their float64 references).

`HostSyncs` is a ``TorchFunctionMode``: within it, every call of ``Tensor.item``, ``__bool__``,
``__int__``, ``__float__``, ``__index__``, ``tolist``, ``cpu``, ``numpy`` (a read of a tensor's
value on the host: on a GPU, a wait for the device) and every ``torch.tensor``/``torch.as_tensor``
of Python data (a copy from the host, which waits for the stream) is recorded with the line of
the package (or test) that made it. It does not see calls that torch makes inside another torch
function (its handler runs with the mode off), nor the index tensor that indexing by a Python
list copies from the host, which it records apart (`HostSyncs.list_indexing`). On CPU ranks every
tensor is a host tensor, so a count there is the count a GPU would feel where host-side counters
are Python numbers, not tensors (as the package keeps them).
"""

from __future__ import annotations

import inspect
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning import Callback
from torch.overrides import TorchFunctionMode

#: Tensor methods that read a value on the host.
READS = frozenset({"item", "__bool__", "__int__", "__float__", "__index__", "tolist", "cpu", "numpy"})
#: Factories that copy Python data into a tensor.
FACTORIES = frozenset({"tensor", "as_tensor"})

#: The reads of a device value on the host that an optimizer step may make: the gradients'
#: agreement, which carries the previous step's failure flag.
HOST_SYNCS_PER_STEP = 1
#: How far a resumed run's losses may lie from the uninterrupted run's.
RESUME_TOLERANCE = 1e-6

#: Where the package lies: places are given relative to the folder that holds it (its
#: repository, or site-packages).
_ROOT = str(Path(__file__).resolve().parents[2])


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


def gpu_shortage(ranks: int) -> str | None:
    """``"runs R ranks, one GPU each, and G GPUs are visible"`` where the ``ranks`` ranks, one
    GPU each, outnumber the GPUs torch sees; ``None`` where they fit."""
    visible = torch.cuda.device_count()
    return None if visible >= ranks else f"runs {ranks} ranks, one GPU each, and {visible} GPUs are visible"


class RecordLosses(Callback):
    """Records each training step's loss; at the end rank 0 saves the list to ``path``
    (``torch.save``), where the process that compares two runs reads it."""

    def __init__(self, path: str | Path) -> None:
        self.path, self.losses = path, []

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.global_rank == 0:
            torch.save(self.losses, self.path)


def take_steps(
    optimizer_class: Callable[..., torch.optim.Optimizer],
    initial: torch.Tensor,
    grads: list[torch.Tensor],
    device: torch.device | str = "cpu",
    **settings: Any,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The weight after ``optimizer_class(**settings)`` took a step for each of ``grads`` from
    ``initial``, on ``device`` (``initial`` and ``grads`` in their dtype there), back on the CPU;
    and the optimizer's state of it."""
    weight = torch.nn.Parameter(initial.to(device, copy=True))
    optimizer = optimizer_class([weight], **settings)
    for grad in grads:
        weight.grad = grad.to(device, copy=True)
        optimizer.step()
    return weight.detach().cpu(), optimizer.state[weight]
