"""The float32 rules compute in IEEE float32 under the TF32 switch, and leave the switch as it was."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_canzona as lc
from lightning_canzona.rules.base import ieee_float32_products

_BACKENDS = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)
#: The products and decompositions whose precision the switch can lower (on CUDA: cuBLAS's TF32).
_PRODUCTS = {"mm", "bmm", "addmm", "baddbmm", "matmul", "_linalg_eigh", "linalg_qr"}


def _switch() -> tuple[str, ...]:
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:
        legacy = "mixed"
    return (legacy, *(backend.fp32_precision for backend in _BACKENDS))


@pytest.fixture
def switch():
    """The TF32 switch of the process put back as it was, whatever a test sets."""
    legacy, saved = torch.get_float32_matmul_precision(), [b.fp32_precision for b in _BACKENDS]
    yield
    torch.set_float32_matmul_precision(legacy)
    for backend, precision in zip(_BACKENDS, saved):
        backend.fp32_precision = precision


class _Precisions(TorchDispatchMode):
    """The switch at every product and decomposition, by the dtype of its first operand."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[torch.dtype, set[tuple[str, ...]]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _PRODUCTS:
            self.seen.setdefault(args[0].dtype, set()).add(_switch())
        return func(*args, **(kwargs or {}))


OPTIMIZERS = {
    "shampoo": (lc.Shampoo, {"start_preconditioning_step": 1}),
    "soap": (lc.SOAP, {"precondition_frequency": 1}),
    "muon float32": (lc.Muon, {"compute_dtype": "float32"}),
    "muon bfloat16": (lc.Muon, {"compute_dtype": "bfloat16"}),
}


@pytest.mark.parametrize("api", ["legacy", "per-backend"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_float32_rules_compute_in_ieee_float32_and_restore_the_tf32_switch(switch, optimizer, api) -> None:
    if api == "legacy":  # as Lightning asks H100 users to
        torch.set_float32_matmul_precision("high")
    else:  # torch's newer API, in which the legacy getter cannot read the switch
        torch.backends.cuda.matmul.fp32_precision = "tf32"
    before = _switch()
    optimizer_class, settings = OPTIMIZERS[optimizer]
    param = torch.nn.Parameter(torch.randn(24, 16))
    stepped = optimizer_class([param], **settings)
    precisions = _Precisions()
    for _ in range(2):  # SOAP: eigh on the first step, QR on the second
        param.grad = torch.randn(24, 16)
        with precisions:
            stepped.step()
        assert _switch() == before
    if optimizer == "muon bfloat16":  # left alone
        assert precisions.seen == {torch.bfloat16: {before}}
    else:
        assert precisions.seen == {torch.float32: {("highest", "ieee", "ieee")}}


class _Rule:
    """A rule's team computation: three rounds, the switch seen at each."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, ...]] = []

    def matmul_dtype(self) -> torch.dtype:
        return torch.float32

    @ieee_float32_products
    def team_direction(self):
        for round_ in range(3):
            self.seen.append(_switch())
            reply = yield round_
            assert reply == 10 * round_
        return "done"


def test_a_team_computation_computes_in_ieee_float32_only_while_it_runs(switch) -> None:
    torch.set_float32_matmul_precision("high")
    rule = _Rule()
    computation, between = rule.team_direction(), []
    request = next(computation)
    with pytest.raises(StopIteration) as stop:
        while True:
            between.append(_switch())  # the engine's turn: other teams' computations, collectives
            request = computation.send(10 * request)
    assert stop.value.value == "done"
    assert rule.seen == [("highest", "ieee", "ieee")] * 3
    assert between == [("high", "tf32", "tf32")] * 3
