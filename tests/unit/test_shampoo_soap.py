import warnings

import pytest
import torch

import lightning_canzona as lc
from lightning_canzona.rules.base import counting_retries
from lightning_canzona.rules.references import reference_shampoo, reference_soap
from lightning_canzona.rules.shampoo import inverse_fourth_root


def _steps(optimizer_class, initial, grads, **kwargs):
    param = torch.nn.Parameter(initial.clone())
    optimizer = optimizer_class([param], **kwargs)
    snapshots = []
    for grad in grads:
        param.grad = grad.clone()
        optimizer.step()
        state = optimizer.state[param].items()
        snapshots.append({key: value.clone() if torch.is_tensor(value) else value for key, value in state})
    return param.detach(), snapshots


@pytest.mark.parametrize("shape, max_dim", [((24, 40), 8192), ((40, 24), 8192), ((16, 48), 32)])
def test_shampoo_matches_explicit_eigh_on_accumulated_factors(shape, max_dim) -> None:
    settings = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, epsilon=1e-4)
    schedule = dict(precondition_frequency=2, start_preconditioning_step=2, max_precond_dim=max_dim)
    initial, grads = torch.randn(shape), [torch.randn(shape) for _ in range(7)]
    ours, states = _steps(lc.Shampoo, initial, grads, **settings, **schedule)
    expected = reference_shampoo(initial, grads, start=2, frequency=2, max_dim=max_dim, **settings)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
    assert ("right" in states[-1]) == (shape[1] <= max_dim)
    # The roots are refreshed at steps 2, 4, 6 and held in between.
    roots = [state["left_root"] for state in states]
    assert torch.equal(roots[1], roots[2]) and not torch.equal(roots[2], roots[3])


def test_shampoos_absolute_epsilon_is_a_ridge_on_each_factor() -> None:
    # Gradients of 1e-2: factors' eigenvalues of ~1e-4 · 24, where an absolute ε of 1e-4 and a
    # floor of 1e-4 · λ_max give different roots.
    settings = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, epsilon=1e-4)
    schedule = dict(precondition_frequency=2, start_preconditioning_step=2, max_precond_dim=8192)
    initial, grads = torch.randn(24, 40), [1e-2 * torch.randn(24, 40) for _ in range(5)]
    absolute, _ = _steps(lc.Shampoo, initial, grads, epsilon_mode="absolute", **settings, **schedule)
    relative, _ = _steps(lc.Shampoo, initial, grads, **settings, **schedule)
    ridge = reference_shampoo(initial, grads, start=2, frequency=2, max_dim=8192, ridge=True, **settings)
    torch.testing.assert_close(absolute, ridge, rtol=1e-4, atol=1e-5)
    assert (relative - ridge).abs().max() > 1e-3  # measured 1.0e-2 to 1.4e-2: the modes differ
    with pytest.raises(ValueError, match=r"epsilon_mode must be one of \('relative', 'absolute'\)"):
        _steps(lc.Shampoo, initial, grads[:1], epsilon_mode="ridge")


def _eigh_failing_in(monkeypatch, *dtypes):
    """``torch.linalg.eigh`` raising as cuSOLVER does when it fails to converge, for matrices
    of ``dtypes`` (LAPACK on a CPU hardly ever fails)."""
    eigh = torch.linalg.eigh

    def failing(matrix, *args, **kwargs):
        if matrix.dtype in dtypes:
            raise torch.linalg.LinAlgError("injected: the algorithm failed to converge")
        return eigh(matrix, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "eigh", failing)
    return eigh


@pytest.mark.parametrize("optimizer", ["soap", "shampoo"])
def test_a_decomposition_that_fails_in_float32_is_computed_in_float64(monkeypatch, optimizer) -> None:
    # A tall matrix: its left factor (40 × 40) has rank 8, as SOAP's first of a tall matrix, where
    # cuSOLVER's float32 eigh fails now and then.
    initial, grads = torch.randn(40, 8), [torch.randn(40, 8)]
    eigh = _eigh_failing_in(monkeypatch, torch.float32)
    with warnings.catch_warnings(), counting_retries() as retried:
        warnings.simplefilter("error")  # a retry that succeeds is a correct run: quiet
        if optimizer == "soap":
            _, (state,) = _steps(lc.SOAP, initial, grads)
        else:
            _, (state,) = _steps(lc.Shampoo, initial, grads, start_preconditioning_step=1)
    assert retried() == 2 and not state["decomposition_failures"]
    for side in ("left", "right"):
        factor = state[side].double()
        if optimizer == "soap":  # the authors' ridge, then float64, rounded to the state's float32
            expected = eigh(factor + 1e-30 * torch.eye(len(factor), dtype=torch.float64)).eigenvectors.flip(
                -1
            )
            assert torch.equal(state[f"{side}_basis"], expected.float())
        else:
            expected = inverse_fourth_root(factor, 1e-6, dtype=torch.float64)
            assert torch.equal(state[f"{side}_root"], expected.float())


def test_a_decomposition_that_fails_in_float64_too_keeps_the_previous_root_and_is_counted(
    monkeypatch,
) -> None:
    initial, grads = torch.randn(40, 8), [torch.randn(40, 8) for _ in range(2)]
    param = torch.nn.Parameter(initial)
    optimizer = lc.Shampoo([param], start_preconditioning_step=1, precondition_frequency=1)
    param.grad = grads[0]
    optimizer.step()
    roots = {key: optimizer.state[param][key].clone() for key in ("left_root", "right_root")}
    _eigh_failing_in(monkeypatch, torch.float32, torch.float64)
    param.grad = grads[1]
    with warnings.catch_warnings(record=True) as caught, counting_retries() as retried:
        warnings.simplefilter("always")
        optimizer.step()
    assert sorted(str(warning.message).split(" failed;")[0] for warning in caught) == [
        "The decomposition for 'left_root' (shape (40, 40))",
        "The decomposition for 'right_root' (shape (8, 8))",
    ]
    assert all("the previous one is kept (tried in float32, then float64)" in str(w.message) for w in caught)
    state = optimizer.state[param]
    assert retried() == 2 and state["decomposition_failures"] == 2
    assert all(torch.equal(state[key], root) for key, root in roots.items())
    assert torch.isfinite(param).all()


def test_shampoo_before_preconditioning_is_adamw() -> None:
    initial, grads = torch.randn(20, 30), [torch.randn(20, 30) for _ in range(4)]
    settings = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    ours, _ = _steps(lc.Shampoo, initial, grads, start_preconditioning_step=10, **settings)
    adamw, _ = _steps(torch.optim.AdamW, initial, grads, **settings)
    torch.testing.assert_close(ours, adamw, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("scale", [1e-2, 1.0])
@pytest.mark.parametrize("shape", [(24, 24), (20, 36), (36, 20)])
def test_soap_matches_the_papers_algorithm_over_two_refresh_periods(shape, scale) -> None:
    settings = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    initial, grads = torch.randn(shape), [scale * torch.randn(shape) for _ in range(8)]
    ours, states = _steps(lc.SOAP, initial, grads, precondition_frequency=3, **settings)
    expected, reference_bases = reference_soap(initial, grads, frequency=3, **settings)
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
    bases = [state["left_basis"] for state in states]
    for step in (4, 7):  # refreshes follow Adam's steps 3 and 6 and change the basis
        assert (bases[step - 1] - bases[step - 2]).abs().max() > 1e-3
        torch.testing.assert_close(
            bases[step - 1].abs(), reference_bases[step - 1].abs(), rtol=1e-3, atol=1e-4
        )
    for step in (2, 3, 5, 6, 8):
        assert torch.equal(bases[step - 1], bases[step - 2])


@pytest.mark.parametrize("scale", [1e-4, 1.0])
def test_soap_first_step_only_starts_the_preconditioner(scale) -> None:
    # The first bases diagonalise the first gradient: rotating it by them would leave rounding
    # off the diagonal for the Adam ratio to turn into ±1 (measured: 0.8–8.7× the step's norm).
    initial, grads = torch.randn(32, 24), [scale * torch.randn(32, 24) for _ in range(2)]
    settings = dict(lr=0.01, weight_decay=0.1)
    weights, states = [], []
    for steps in (1, 2):
        weight, state = _steps(lc.SOAP, initial, grads[:steps], **settings)
        weights.append(weight)
        states.append(state[-1])
    torch.testing.assert_close(weights[0], initial * (1 - 0.01 * 0.1), rtol=0, atol=0)
    assert not states[0]["exp_avg"].any() and not states[0]["exp_avg_sq"].any()
    eigenvalues = torch.linalg.eigvalsh(grads[0] @ grads[0].T).flip(-1)
    basis = states[0]["left_basis"]
    torch.testing.assert_close(
        torch.diag(basis.T @ states[0]["left"] @ basis), 0.05 * eigenvalues, rtol=1e-4, atol=1e-6 * scale**2
    )
    # The second step is Adam's first: a step of about one per entry in the rotated coordinates.
    step = (weights[0] * (1 - 0.01 * 0.1) - weights[1]) / 0.01
    assert 0.5 < step.norm() / (32 * 24) ** 0.5 < 1.5


def test_a_checkpoint_from_before_a_setting_existed_loads_with_its_default() -> None:
    param = torch.nn.Parameter(torch.randn(8, 12))
    saved = lc.Shampoo([param]).state_dict()
    for group in saved["param_groups"]:
        del group["epsilon_mode"]  # saved before Shampoo had it
    optimizer = lc.Shampoo([param])
    optimizer.load_state_dict(saved)
    assert optimizer.param_groups[0]["epsilon_mode"] == "relative"
    param.grad = torch.randn(8, 12)
    optimizer.step()


def test_soap_leaves_a_side_over_max_precond_dim_unrotated() -> None:
    initial, grads = torch.randn(8, 40), [1e-2 * torch.randn(8, 40) for _ in range(3)]
    _, states = _steps(lc.SOAP, initial, grads, max_precond_dim=16)
    assert "left_basis" in states[-1] and "right_basis" not in states[-1]


@pytest.mark.parametrize("row_blocks", [None, 2])
def test_soaps_update_first_order_is_the_authors_and_skips_the_first_decay(row_blocks) -> None:
    # The steps D_t depend on the gradients only: taken from a run without decay, they give each
    # order's weights by its recursion (float64 weights: the recursion's own rounding is 1e-16).
    generator = torch.Generator().manual_seed(0)
    initial = torch.randn(12, 20, dtype=torch.float64, generator=generator)
    grads = [torch.randn(12, 20, dtype=torch.float64, generator=generator) for _ in range(6)]
    lr, decay = 3e-3, 0.1

    def trajectory(weight_decay: float, **settings) -> list[torch.Tensor]:
        weight = torch.nn.Parameter(initial.clone())
        group = {"params": [weight], "algorithm": "soap"} | ({"row_blocks": row_blocks} if row_blocks else {})
        optimizer = lc.SOAP([group], lr=lr, weight_decay=weight_decay, precondition_frequency=2, **settings)
        weights = [initial]
        for grad in grads:
            weight.grad = grad.clone()
            optimizer.step()
            weights.append(weight.detach().clone())
        return weights

    undecayed = trajectory(0.0)
    steps = [(before - after) / lr for before, after in zip(undecayed, undecayed[1:])]
    assert not steps[0].any()  # the first step only starts the preconditioner
    authors, default = trajectory(decay, weight_decay_order="update_first"), trajectory(decay)
    assert torch.equal(authors[1], initial)  # no decay either on the authors' first step
    for t, step in enumerate(steps[1:], start=2):
        torch.testing.assert_close(
            authors[t], (authors[t - 1] - lr * step) * (1 - lr * decay), rtol=1e-12, atol=0
        )
    for t, step in enumerate(steps, start=1):
        torch.testing.assert_close(
            default[t], default[t - 1] * (1 - lr * decay) - lr * step, rtol=1e-12, atol=0
        )
    # A plan is built for its rules (a changed rule rebuilds it, a collective that moves the state):
    # the group's step count is no part of a rule's identity.
    optimizer = lc.SOAP([torch.nn.Parameter(initial.clone())], weight_decay_order="update_first")
    before = optimizer.rule_of(optimizer.param_groups[0])
    optimizer.param_groups[0]["params"][0].grad = grads[0].clone()
    optimizer.step()
    after = optimizer.rule_of(optimizer.param_groups[0])
    assert before.first_step and not after.first_step and before == after and hash(before) == hash(after)
    with pytest.raises(ValueError, match=r"param_groups\[0\] \(soap\): weight_decay_order must be one of"):
        lc.SOAP([torch.nn.Parameter(initial.clone())], weight_decay_order="after")
