"""An NCCL process group as the package sees it, emulated on CPU ranks (gloo underneath).

On a GPU, NCCL takes CUDA tensors only: a collective given a host tensor (one made from Python
data without a device, or moved with ``.cpu()``) fails. And a tensor that travels inside a
``*_object`` collective is pickled through the host and unpickled onto the sender's device
index on the receiver. On CPU ranks every tensor is a host tensor, so neither can fail there by
itself. `nccl_like` makes both fail, and names the backend ``"nccl"``:

- a `torch.overrides.TorchFunctionMode` follows which tensors would be on the host in a GPU run:
  those that a factory (``torch.tensor``, ``torch.zeros``, ``torch.from_numpy``…) made without a
  ``device``, those that ``.cpu()`` made, and what every op computes from such tensors alone
  (``.to(device)`` moves one back: the code chose a device, which is the CPU on CPU ranks);
- tensor collectives in ``torch.distributed`` refuse host tensors, object collectives refuse
  objects that hold any other tensor;
- ``torch.distributed.get_backend`` answers ``"nccl"`` to the package, so that every choice it
  makes by backend takes NCCL's branch.

Everything else runs as it would: the collectives are gloo's, on the same tensors. `CALLS`
records each tensor collective (name, the dtypes of its tensors, its group), for tests that
check what travels. With ``CANZONA_TEST_DEVICE=cuda`` the process group is NCCL itself: only the
record is kept (`multiprocess.run_on_ranks`).
"""

from __future__ import annotations

import functools
import io
import pickle
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.overrides import TorchFunctionMode

#: ``torch.distributed`` collectives that take tensors.
TENSOR_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
)
#: ``torch.distributed`` collectives that pickle Python objects.
OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
#: Factories that make a tensor from Python data: on the host unless given a device.
FACTORIES = {
    torch.tensor,
    torch.as_tensor,
    torch.scalar_tensor,
    torch.from_numpy,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.linspace,
    torch.eye,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.randperm,
}
_HOST = "_emulated_nccl_host"


@dataclass(frozen=True)
class Call:
    """A tensor collective as it was called."""

    name: str
    dtypes: tuple[torch.dtype, ...]
    group: Any


#: The tensor collectives called inside `nccl_like`, in order.
CALLS: list[Call] = []


def on_host(tensor: Tensor) -> bool:
    """Whether ``tensor`` would be a host tensor in a GPU run (inside `nccl_like`)."""
    return getattr(tensor, _HOST, False)


def _tensors(values: Any) -> Iterator[Tensor]:
    """The tensors among ``values`` and one level into its lists, tuples and dicts' values."""
    for value in values:
        if isinstance(value, Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (item for item in value if isinstance(item, Tensor))
        elif isinstance(value, dict):
            yield from (item for item in value.values() if isinstance(item, Tensor))


def _device_argument(args: tuple, kwargs: dict) -> Any:
    """The device that a ``Tensor.to`` call names, or ``None``."""
    if "device" in kwargs:
        return kwargs["device"]
    for arg in args[1:]:
        if isinstance(arg, (str, torch.device, int)) and not isinstance(arg, bool):
            return arg
        if isinstance(arg, Tensor):
            return arg.device
    return None


class HostTensors(TorchFunctionMode):
    """Marks the tensors that a GPU run would hold on the host (see the module docstring)."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        inputs = list(_tensors((*args, *kwargs.values())))
        moves = func is Tensor.cuda or (func is Tensor.to and _device_argument(args, kwargs) is not None)
        if func is Tensor.cpu or moves:
            if any(result is tensor for tensor in inputs) and on_host(result) != (func is Tensor.cpu):
                result = result.view_as(result)  # moved: a tensor of its own, as on a GPU
            if func is Tensor.cpu:
                setattr(result, _HOST, True)
            return result
        if func in FACTORIES:
            host = "device" not in kwargs and all(map(on_host, inputs))
        else:
            host = bool(inputs) and all(map(on_host, inputs))
        if host:
            for output in _tensors([result]):
                if not any(output is tensor for tensor in inputs):
                    setattr(output, _HOST, True)
        return result


class _TensorFinder(pickle.Pickler):
    """Pickles an object and keeps every tensor it meets."""

    def __init__(self) -> None:
        super().__init__(io.BytesIO())
        self.tensors: list[Tensor] = []

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Tensor):
            self.tensors.append(obj)
        return NotImplemented


def _recorded(name: str, collective: Callable, refuse_host_tensors: bool) -> Callable:
    """``collective``, recorded in `CALLS`; refusing host tensors as NCCL would (``refuse_host_tensors``)."""

    @functools.wraps(collective)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        tensors = list(_tensors((*args, *kwargs.values())))
        host = [tensor for tensor in tensors if on_host(tensor)] if refuse_host_tensors else []
        if host:
            described = ", ".join(f"{t.dtype} {tuple(t.shape)}" for t in host)
            raise RuntimeError(
                f"emulated NCCL: torch.distributed.{name} got host tensors ({described}), made without "
                "a device or moved to the host; NCCL takes tensors on the process group's GPU only."
            )
        CALLS.append(Call(name, tuple(t.dtype for t in tensors), kwargs.get("group")))
        return collective(*args, **kwargs)

    return recorded


def _refuse_device_tensors(name: str, collective: Callable) -> Callable:
    @functools.wraps(collective)
    def checked(*args: Any, **kwargs: Any) -> Any:
        finder = _TensorFinder()
        finder.dump([arg for arg in args if not isinstance(arg, dist.ProcessGroup)])
        moved = [tensor for tensor in finder.tensors if not on_host(tensor)]
        if moved:
            described = ", ".join(f"{t.dtype} {tuple(t.shape)}" for t in moved)
            raise RuntimeError(
                f"emulated NCCL: torch.distributed.{name} pickles device tensors ({described}): they "
                "travel through the host and arrive on the sender's device index. Send tensors with "
                "tensor collectives."
            )
        return collective(*args, **kwargs)

    return checked


def _backend_as_the_package_sees_it(get_backend: Callable) -> Callable:
    """``get_backend`` that answers ``"nccl"`` to the package (torch's own callers, which would
    then look for NCCL's library, get the true answer)."""

    @functools.wraps(get_backend)
    def backend(group: Any = None) -> str:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        return "nccl" if caller.startswith("lightning_canzona") else get_backend(group)

    return backend


@contextmanager
def nccl_like(emulate: bool = True) -> Iterator[None]:
    """Within the block, this rank's process group behaves as NCCL would towards the package
    (``emulate``), or, on a real NCCL group, only records its tensor collectives in `CALLS`."""
    originals = {
        name: getattr(dist, name, None) for name in (*TENSOR_COLLECTIVES, *OBJECT_COLLECTIVES, "get_backend")
    }
    originals = {name: value for name, value in originals.items() if value is not None}
    CALLS.clear()
    try:
        for name in TENSOR_COLLECTIVES:
            if name in originals:
                setattr(dist, name, _recorded(name, originals[name], refuse_host_tensors=emulate))
        if not emulate:
            yield
            return
        for name in OBJECT_COLLECTIVES:
            setattr(dist, name, _refuse_device_tensors(name, originals[name]))
        dist.get_backend = _backend_as_the_package_sees_it(originals["get_backend"])
        with HostTensors():
            yield
    finally:
        for name, value in originals.items():
            setattr(dist, name, value)
