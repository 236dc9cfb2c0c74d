"""The contract torch.optim users assume, kept by all four optimizers on one process: tensor
learning rates and schedulers, copies and pickles, state-dict round trips and hooks, closures,
zero-gradient steps, and the inputs they refuse (docs/optimizers.md lists where they differ from
torch.optim on purpose)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import lightning_canzona as lc
from lightning_canzona.models.qwen3 import Qwen3, Qwen3Config

OPTIMIZERS = {
    "muon": (lc.Muon, {"compute_dtype": "float32"}),
    "normuon": (lc.NorMuon, {"compute_dtype": "float32"}),
    "shampoo": (lc.Shampoo, {"precondition_frequency": 2, "start_preconditioning_step": 2}),
    "soap": (lc.SOAP, {"precondition_frequency": 2}),
}


def _params(seed: int = 0) -> list[nn.Parameter]:
    """A matrix, a wide one and a vector: a matrix group and an AdamW group."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(6, 4), (3, 8), (5,)]
    return [nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]


def _build(name: str, params, **overrides) -> lc.MatrixOptimizer:
    cls, kwargs = OPTIMIZERS[name]
    return cls(params, **{"lr": 0.02, **kwargs, **overrides})


def _steps(optimizer, params, seeds, schedulers=()) -> None:
    for seed in seeds:
        generator = torch.Generator().manual_seed(seed)
        for param in params:
            param.grad = torch.randn(param.shape, generator=generator)
        optimizer.step()
        for scheduler in schedulers:
            scheduler.step()


def _equal(params, others) -> bool:
    return all(torch.equal(a, b) for a, b in zip(params, others))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_tensor_learning_rate_steps_as_its_number_and_a_scheduler_writes_it_in_place(name) -> None:
    numbers, tensors = _params(), _params()
    by_number = _build(name, numbers, lr=2**-6)  # a float32 number: the tensor holds it exactly
    lr = torch.tensor(2**-6)
    by_tensor = _build(name, tensors, lr=lr)
    matrix_lr, adamw_lr = (group["lr"] for group in by_tensor.param_groups)
    assert matrix_lr is lr and adamw_lr is not lr and torch.equal(adamw_lr, lr)  # each group's own
    schedule = [0.5, 1.0, 0.25]  # per group: the matrix group's, then AdamW's
    schedulers = [
        torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s: schedule[s % 3], lambda s: schedule[-s % 3]])
        for optimizer in (by_number, by_tensor)
    ]
    _steps(by_number, numbers, range(4), schedulers[:1])
    _steps(by_tensor, tensors, range(4), schedulers[1:])
    assert _equal(numbers, tensors)
    assert by_tensor.param_groups[0]["lr"] is lr and [float(g["lr"]) for g in by_tensor.param_groups] == [
        float(g["lr"]) for g in by_number.param_groups
    ]
    with pytest.raises(ValueError, match=r"Tensor lr must be 1-element, got shape \(2,\)"):
        _build(name, _params(), lr=torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match=r"lr must be a finite number >= 0, got tensor\(-1\.\)"):
        _build(name, _params(), lr=torch.tensor(-1.0))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_copy_or_an_unpickled_optimizer_has_every_attribute_and_steps_like_the_original(name) -> None:
    params = _params()
    optimizer = _build(name, params)
    _steps(optimizer, params, range(3))
    for copied in (copy.deepcopy(optimizer), pickle.loads(pickle.dumps(optimizer))):
        public = {key for key in vars(optimizer) if not key.startswith("_")}
        assert public == {key for key in vars(copied) if not key.startswith("_")}
        assert copied.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]
        copy_params = [p for group in copied.param_groups for p in group["params"]]
        original, twin = [p.detach().clone() for p in params], [p.detach().clone() for p in copy_params]
        reference = _build(name, original)  # the original's continuation, without moving it
        reference.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # not its tensors
        _steps(reference, original, range(3, 6))
        _steps(copied, copy_params, range(3, 6))
        assert _equal(original, copy_params) and not _equal(twin, copy_params)


def test_a_copy_that_would_share_what_it_is_bound_to_is_refused_with_the_way_to_copy() -> None:
    model = Qwen3(Qwen3Config(64, 16, 32, 1, 2, 1, head_dim=8, qk_norm=False))
    optimizer = lc.Muon(lc.matrix_param_groups(model), qk_clip=lc.QKClip(threshold=50.0))
    copy.deepcopy(optimizer)  # not attached yet: its settings only
    lc.attach_qk_clip(model, optimizer)
    for attempt in (copy.deepcopy, pickle.dumps):
        with pytest.raises(
            TypeError, match=r"QK-clip attached .*\(new\.load_state_dict\(optimizer\.state_dict\(\)\)"
        ):
            attempt(optimizer)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_state_dict_round_trips_runs_its_hooks_and_keeps_entries_of_any_kind(name) -> None:
    params = _params()
    optimizer = _build(name, params)
    _steps(optimizer, params, range(3))
    saved = optimizer.state_dict()
    fresh_params = [nn.Parameter(p.detach().clone()) for p in params]
    fresh = _build(name, fresh_params)
    calls = []
    fresh.register_load_state_dict_pre_hook(lambda opt, sd: calls.append("load pre"))
    fresh.register_load_state_dict_post_hook(lambda opt: calls.append("load post"))
    fresh.register_state_dict_pre_hook(lambda opt: calls.append("save pre"))
    fresh.register_state_dict_post_hook(lambda opt, sd: {**sd, "note": "written by a hook"})
    fresh.load_state_dict(copy.deepcopy(saved))
    reloaded = fresh.state_dict()
    assert calls == ["load pre", "load post", "save pre"] and reloaded.pop("note") == "written by a hook"
    assert reloaded["param_groups"] == saved["param_groups"]  # nothing added: no torch defaults
    torch.testing.assert_close(reloaded["state"], saved["state"], rtol=0, atol=0)
    _steps(optimizer, params, range(3, 5))
    _steps(fresh, fresh_params, range(3, 5))
    assert _equal(params, fresh_params)
    # Entries that are not a parameter's dict (torch's hooks write such), saved and loaded as they are.
    optimizer.state["steps seen"] = 5
    with_entry = optimizer.state_dict()
    assert with_entry["state"]["steps seen"] == 5
    fresh.load_state_dict(with_entry)
    assert fresh.state["steps seen"] == 5


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_closure_is_evaluated_with_gradients_and_zero_or_absent_gradients_change_nothing(name) -> None:
    params = _params()
    optimizer = _build(name, params, weight_decay=0.0)  # AdamW's too: it takes the matrices' by default
    before = [p.detach().clone() for p in params]
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()  # from fresh state, a zero gradient moves nothing
    assert _equal(before, params)
    target = [p.detach() for p in _params(seed=1)]

    def closure() -> torch.Tensor:
        assert torch.is_grad_enabled()
        optimizer.zero_grad()
        loss = sum(((p - t) ** 2).sum() for p, t in zip(params, target))
        loss.backward()
        return loss

    with torch.no_grad():
        first = optimizer.step(closure)
    for _ in range(3):
        last = optimizer.step(closure)
    assert last < first
    before = [p.detach().clone() for p in params]
    optimizer.zero_grad()  # None: skipped, whatever the state holds
    optimizer.step()
    assert _equal(before, params)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_inputs_torch_optim_refuses_are_refused_alike(name) -> None:
    matrix, wide, _ = _params()
    with pytest.raises(TypeError, match="params argument given to the optimizer should be an iterable"):
        _build(name, matrix)
    with pytest.warns(UserWarning, match="a parameter group with duplicate parameters"):
        _build(name, [matrix, matrix])
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        _build(name, [{"params": [matrix]}, {"params": [matrix]}])
    with pytest.raises(ValueError, match="all optimizer params should be with/without names"):
        _build(name, [("matrix", matrix), wide])


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_complex_parameters_and_sparse_gradients_are_refused_naming_the_parameter(name) -> None:
    cls = OPTIMIZERS[name][0].__name__
    weights = nn.Parameter(torch.randn(4, 3, dtype=torch.complex64))
    with pytest.raises(
        ValueError, match=rf"Parameter 'mixer' of shape \(4, 3\) is complex .* {cls} updates real"
    ):
        _build(name, [("mixer", weights)])
    embedding = nn.Embedding(10, 4, sparse=True)
    optimizer = _build(name, [("embedding.weight", embedding.weight)])
    embedding(torch.tensor([1, 2])).sum().backward()
    before = embedding.weight.detach().clone()
    with pytest.raises(
        RuntimeError, match=rf"{cls} does not support sparse gradients: parameter 'embedding.weight'"
    ):
        optimizer.step()
    assert torch.equal(embedding.weight, before)


@pytest.mark.parametrize("shape", [(16, 3, 3, 3), (64, 3, 3, 3), (4, 8, 3, 1)])  # wide, tall
def test_a_conv_weight_is_updated_as_the_matrix_out_by_in_times_kernel(shape) -> None:
    """As the Muon reference treats it: torch.optim.Muon on the flattened weight is the update."""
    conv = nn.Parameter(torch.randn(shape))
    flat = nn.Parameter(conv.detach().flatten(1).clone())
    ours = lc.Muon([conv], lr=0.02, compute_dtype="bfloat16")
    reference = torch.optim.Muon([flat], lr=0.02)
    for seed in range(3):
        grad = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        conv.grad, flat.grad = grad, grad.flatten(1).clone()
        ours.step()
        reference.step()
    assert torch.equal(conv.detach().flatten(1), flat.detach())
    shampoo = lc.Shampoo([conv], start_preconditioning_step=1)
    shampoo.step()
    assert shampoo.state[conv]["left"].shape == (shape[0], shape[0])  # the flattened matrix's factors
