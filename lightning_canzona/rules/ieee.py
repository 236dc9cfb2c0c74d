"""IEEE float32 products in the rules' matrix math, whatever torch's TF32 switch says.

Lightning asks the users of an H100 to call ``torch.set_float32_matmul_precision("high")``, which
lets every float32 matmul of the process run in TF32 (a 10-bit mantissa). A rule whose products are
float32 — Shampoo's and SOAP's factors, roots, rotations and bases, Muon with
``compute_dtype=float32`` — is float32 for its precision (TF32 rounds each operand to 11
significant bits, ≈5e-4 relative, where float32 keeps 24: a factor's small eigenvalues are lost
in it), so `ieee_float32_products` runs it with IEEE float32 matmuls and restores the switch
after. That is also what the planner
prices: a float32 rule's FLOPs at float32 rates (67 TFLOP/s on an H100, not TF32's 495; see
`lightning_canzona.planning.devices`). Products in bfloat16 (Muon's default) are left alone, and
so is everything outside the rules (the model's forward and backward).

torch keeps the switch per process, not per thread: while a rule computes, every float32 matmul
of the process is IEEE (the optimizer step's thread runs nothing else meanwhile). Switching and
restoring took 12 µs per call here where TF32 was on through the legacy API (25 µs through the
per-backend one), 2 µs where it was off: once per matrix (or batch), next to its many kernels.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Generator, Iterator
from typing import Any, TypeVar

import torch

#: The backends whose float32 matmuls TF32 (or, on a CPU, bf16) can take over.
_BACKENDS = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)

Method = TypeVar("Method", bound=Callable[..., Any])


@contextlib.contextmanager
def ieee_float32() -> Iterator[None]:
    """Float32 matmuls in IEEE float32 inside, the switch as it was after.

    The switch is set in torch's two APIs: the legacy one (``set_float32_matmul_precision``,
    ``allow_tf32``), which Lightning recommends and which ``torch.compile``'s guards read, and the
    per-backend one (``torch.backends.cuda.matmul.fp32_precision``), which the kernels read;
    torch refuses to read a legacy value that disagrees with the per-backend one, so both stay
    consistent inside, and each gets its own value back after.
    """
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:  # set through the per-backend API alone, which the legacy one contradicts
        legacy = None
    if legacy == "highest":  # readable and highest: no backend is in TF32 or bf16
        yield
        return
    saved = [backend.fp32_precision for backend in _BACKENDS]
    if legacy is not None:
        torch.set_float32_matmul_precision("highest")
    for backend in _BACKENDS:
        backend.fp32_precision = "ieee"
    try:
        yield
    finally:
        if legacy is not None:
            torch.set_float32_matmul_precision(legacy)
        for backend, precision in zip(_BACKENDS, saved):
            backend.fp32_precision = precision


def ieee_float32_products(method: Method) -> Method:
    """A `MatrixRule` method (``direction``, ``team_direction``) run in `ieee_float32` where the
    rule's matmul dtype (`MatrixRule.matmul_dtype`) is float32.

    A team computation (a generator, `MatrixRule.team_direction`) runs in it each time it is
    resumed, not while the engine holds it between rounds, where the teams' computations take
    turns.
    """

    @functools.wraps(method)
    def in_ieee_float32(rule: Any, *args: Any, **kwargs: Any) -> Any:
        if rule.matmul_dtype() != torch.float32:
            return method(rule, *args, **kwargs)
        with ieee_float32():
            result = method(rule, *args, **kwargs)
        return _resumed_in_ieee_float32(result) if isinstance(result, Generator) else result

    return in_ieee_float32  # type: ignore[return-value]


def _resumed_in_ieee_float32(computation: Generator[Any, Any, Any]) -> Generator[Any, Any, Any]:
    reply = None
    while True:
        with ieee_float32():
            try:
                request = computation.send(reply)
            except StopIteration as stop:
                return stop.value
        reply = yield request
