"""bf16 and fp16 parameters: each elementwise update rounds once, as torch.optim's; or, with
``stochastic_rounding``, rounds up or down at random, unbiased, alike on every replica."""

from __future__ import annotations

import pytest
import torch
from multiprocess import DEVICE, run_on_ranks
from test_engine_exactness import MESHES, Net, _gradients, _groups, _parallelize
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor

import lightning_canzona as lc
from lightning_canzona.rules.base import round_stochastically_

LOW = [torch.bfloat16, torch.float16]
BF16 = torch.bfloat16
#: The state keys that ``state_dtype`` keeps in bf16 (a stack's matrices prefix theirs).
MOMENTS = ("momentum_buffer", "exp_avg", "exp_avg_sq")


def _mesh(name: str):
    shape, names = MESHES[name]
    return init_device_mesh(DEVICE, shape, mesh_dim_names=names)


def _steps(make, params, grads) -> None:
    optimizer = make(params)
    for step_grads in grads:
        for param, grad in zip(params, step_grads):
            param.grad = grad.clone()
        optimizer.step()


def _copies(tensors, dtype):
    return [torch.nn.Parameter(t.clone().to(dtype)) for t in tensors]


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_low_precision_weights_equal_torch_optim_muon_bit_for_bit(dtype) -> None:
    initial = [0.3 * (1 + 0.1 * torch.randn(64, 96)), torch.randn(64, 64) / 8]
    grads = [[torch.randn_like(t).to(dtype) for t in initial] for _ in range(3)]
    settings = {"lr": 0.02, "weight_decay": 0.1}
    ours, theirs = _copies(initial, dtype), _copies(initial, dtype)
    _steps(lambda p: lc.Muon(p, **settings, compute_dtype="bfloat16"), ours, grads)
    _steps(lambda p: torch.optim.Muon(p, **settings), theirs, grads)
    for mine, reference in zip(ours, theirs):
        assert torch.equal(mine, reference)
    assert not torch.equal(ours[0], initial[0].to(dtype))


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_a_tall_matrix_rounds_once_as_torch_optim_muon_on_its_transpose(dtype) -> None:
    # torch.optim.Muon adds a tall matrix's update through a transposed view, and the CPU kernel
    # for strided low-precision operands rounds alpha·update before the sum: two roundings. The
    # update here is contiguous (one rounding), as torch's own on the wide transpose, whose
    # learning-rate scale is the same under match_rms_adamw.
    initial = 0.3 * (1 + 0.1 * torch.randn(96, 64))
    grads = [[torch.randn(96, 64).to(dtype)] for _ in range(3)]
    settings = {"lr": 0.02, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
    (ours,), (theirs,) = _copies([initial], dtype), _copies([initial.T.contiguous()], dtype)
    _steps(lambda p: lc.Muon(p, **settings, compute_dtype="bfloat16"), [ours], grads)
    _steps(lambda p: torch.optim.Muon(p, **settings), [theirs], [[g.T.contiguous()] for (g,) in grads])
    assert torch.equal(ours, theirs.T)


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_low_precision_adamw_groups_equal_torch_optim_adamw_bit_for_bit(dtype) -> None:
    initial = [1 + 0.1 * torch.randn(64), 0.01 * torch.randn(33), 0.3 * torch.ones(7)]
    grads = [[torch.randn_like(t).to(dtype) for t in initial] for _ in range(5)]
    settings = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    ours, theirs = _copies(initial, dtype), _copies(initial, dtype)
    _steps(
        lambda p: lc.Muon(
            [{"params": p, "algorithm": "adamw"}],
            adamw_lr=settings["lr"],
            adamw_betas=settings["betas"],
            adamw_eps=settings["eps"],
            weight_decay=settings["weight_decay"],
        ),
        ours,
        grads,
    )
    _steps(lambda p: torch.optim.AdamW(p, foreach=False, **settings), theirs, grads)
    for mine, reference in zip(ours, theirs):
        assert torch.equal(mine, reference)


@pytest.mark.parametrize(
    "optimizer",
    [lc.Shampoo, lc.SOAP, lambda p: lc.Muon(p, compute_dtype="float32")],
    ids=["shampoo", "soap", "muon-float32"],
)
def test_a_float32_step_into_bf16_weights_is_rounded_once(optimizer) -> None:
    # Shampoo and SOAP (and Muon computing in float32) hand float32 directions to bf16 weights.
    param = torch.nn.Parameter((0.3 * (1 + 0.1 * torch.randn(48, 64))).bfloat16())
    direction = torch.randn(48, 64) * 0.05
    built = optimizer([param])
    rule = built.rule_of(built.param_groups[0])
    lr, decay = 0.02, 0.1
    decayed = param.detach() * (1 - lr * decay)  # rounded once, as Tensor.mul_
    scale = rule.lr_scale(param.shape)
    expected = torch.add(decayed, direction, alpha=-lr * scale).bfloat16()  # in float32, rounded once
    twice = torch.add(decayed, direction.bfloat16(), alpha=-lr * scale)  # the direction rounded first
    with torch.no_grad():
        rule.apply([param], [direction], lr=lr, weight_decay=decay, shapes=[param.shape])
    assert param.dtype == torch.bfloat16 and torch.equal(param, expected)
    assert not torch.equal(expected, twice)  # the test tells the two apart


def _bf16_on_every_path(rank: int, world_size: int) -> None:
    mesh = _mesh("dp4")
    muon = {"lr": 0.02, "compute_dtype": "float32", "adamw_lr": 1e-2}
    soap = {"lr": 1e-2, "precondition_frequency": 2}
    for optimizer_class, kwargs, dtype in (
        (lc.Muon, muon, BF16),
        (lc.Shampoo, {"lr": 1e-2, "precondition_frequency": 2, "start_preconditioning_step": 2}, BF16),
        (lc.SOAP, soap, BF16),
        # float32 weights, bf16 state: the momentum and moments round once a step, elementwise on
        # each shard as on the whole tensor, SOAP's on each matrix's owner.
        (lc.Muon, {**muon, "state_dtype": "bfloat16"}, torch.float32),
        (lc.SOAP, {**soap, "state_dtype": "bfloat16"}, torch.float32),
    ):
        torch.manual_seed(0)
        reference_model = Net().to(DEVICE, dtype)
        torch.manual_seed(0)
        model = _parallelize(Net().to(DEVICE, dtype), mesh)
        reference = optimizer_class(_groups(reference_model), **kwargs)
        optimizer = optimizer_class(_groups(model), **kwargs)
        params = dict(model.named_parameters())
        shapes = {name: p.shape for name, p in reference_model.named_parameters()}
        for step in range(3):
            full = {n: None if g is None else g.to(dtype) for n, g in _gradients(step, shapes).items()}
            for name, param in params.items():
                grad = full[name]
                param.grad = None if grad is None else distribute_tensor(grad, mesh, param.placements)
            for name, param in reference_model.named_parameters():
                param.grad = full[name]
            optimizer.step()
            reference.step()
        # Data parallelism alone reorders no sum: every matrix's float32 direction is the one
        # process's, so each rounding into the bf16 weights (or state) is too, bit for bit.
        for name, expected in reference_model.named_parameters():
            actual = params[name]
            local = distribute_tensor(expected.detach(), mesh, actual.placements).to_local()
            assert actual.dtype == dtype and torch.equal(actual.to_local(), local), (
                optimizer_class,
                name,
            )
        if "state_dtype" in kwargs:  # the momentum and moments this rank holds, and only they, in bf16
            held = {
                (name, key): value.dtype
                for name, param in params.items()
                for key, value in optimizer.state[param].items()
                if isinstance(value, torch.Tensor)
            }
            moments = {at: dtype for at, dtype in held.items() if at[1].endswith(MOMENTS)}
            assert moments and set(moments.values()) == {BF16}, moments
            assert all(dtype == torch.float32 for at, dtype in held.items() if at not in moments), held


def test_bf16_weights_on_every_distributed_path_equal_one_process_bit_for_bit() -> None:
    run_on_ranks(4, _bf16_on_every_path)


def test_bf16_state_rounds_the_float32_momentum_and_moments_once_a_step() -> None:
    torch.manual_seed(0)
    weight, bias = torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(8))
    optimizer = lc.Muon([("weight", weight), ("bias", bias)], state_dtype="bfloat16", compute_dtype="float32")
    grads = [(torch.randn(16, 8), torch.randn(8)) for _ in range(2)]
    momentum, exp_avg = torch.zeros(16, 8), torch.zeros(8)
    for weight_grad, bias_grad in grads:
        weight.grad, bias.grad = weight_grad, bias_grad
        optimizer.step()
        momentum = momentum.lerp(weight_grad, 1 - 0.95).bfloat16().float()  # in float32, rounded once
        exp_avg = exp_avg.lerp(bias_grad, 1 - 0.9).bfloat16().float()
    assert torch.equal(optimizer.state[weight]["momentum_buffer"], momentum.bfloat16())
    assert torch.equal(optimizer.state[bias]["exp_avg"], exp_avg.bfloat16())
    assert weight.dtype == torch.float32
    with pytest.raises(ValueError, match="state_dtype must be None .* got 'float16'"):
        lc.Muon([weight], state_dtype="float16")


def test_stochastic_rounding_lands_on_a_neighbour_and_is_unbiased() -> None:
    values = torch.randn(4096) * torch.logspace(-3, 3, 4096)
    down = values.bfloat16().float()
    # The bf16 neighbours of each value: the nearest, and the next one past it towards the value.
    toward = torch.where(
        down < values, torch.full_like(values, float("inf")), torch.full_like(values, -float("inf"))
    )
    other = torch.nextafter(down.bfloat16(), toward.bfloat16()).float()
    other = torch.where(down == values, down, other)
    low, high = torch.minimum(down, other), torch.maximum(down, other)
    samples = []
    for seed in range(256):
        target = torch.empty(4096, dtype=torch.bfloat16)
        round_stochastically_(target, values.clone(), seed)
        rounded = target.float()
        assert bool(((rounded == low) | (rounded == high)).all())
        samples.append(rounded)
    mean = torch.stack(samples).mean(0)
    spacing = (high - low).clamp_min(torch.finfo(torch.float32).tiny)
    # Each element's mean over 256 draws is within 5 standard errors (≤ spacing/32) of its value.
    assert bool(((mean - values).abs() <= 5 * spacing / 32 + 1e-12).all())
    target = torch.empty(4096, dtype=torch.bfloat16)
    round_stochastically_(target, values.clone(), 0)
    assert torch.equal(target.float(), samples[0])  # the seed decides


def test_stochastic_rounding_follows_steps_below_bf16_precision() -> None:
    # 0.3 in bf16 is 0.30078125, with neighbours 0.00195 apart: an AdamW step of 1e-4 rounded
    # to nearest never lands; rounded stochastically it lands on average.
    moved = {}
    for dtype, stochastic in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):
        start = torch.full((64, 64), 0.3).to(dtype)
        param = torch.nn.Parameter(start.clone())
        optimizer = lc.Muon(
            [{"params": [param], "algorithm": "adamw"}],
            adamw_lr=1e-4,
            weight_decay=0.0,
            stochastic_rounding=stochastic,
        )
        for _ in range(20):
            param.grad = -torch.ones_like(param)
            optimizer.step()
        moved[dtype, stochastic] = float((param.detach().float() - start.float()).mean())
    assert moved[torch.float32, False] == pytest.approx(20e-4, rel=1e-3)
    assert moved[torch.bfloat16, False] == 0.0
    assert moved[torch.bfloat16, True] == pytest.approx(20e-4, rel=0.05)


def test_a_resumed_run_rounds_stochastically_as_the_uninterrupted_one() -> None:
    initial = [torch.randn(32, 48) / 8, torch.ones(48)]
    grads = [[torch.randn_like(t).bfloat16() for t in initial] for _ in range(3)]

    def make(params):
        return lc.Muon(params, lr=0.02, adamw_lr=1e-3, stochastic_rounding=True)

    uninterrupted = _copies(initial, torch.bfloat16)
    _steps(make, uninterrupted, grads)
    resumed = _copies(initial, torch.bfloat16)
    first = make(resumed)
    for step_grads in grads[:2]:
        for param, grad in zip(resumed, step_grads):
            param.grad = grad.clone()
        first.step()
    second = make(resumed)
    second.load_state_dict(first.state_dict())
    for param, grad in zip(resumed, grads[2]):
        param.grad = grad.clone()
    second.step()
    assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted))


def _stochastic_on_dp_and_tp(rank: int, world_size: int) -> None:
    mesh = _mesh("dp2xtp2")
    kwargs = {"lr": 2e-3, "compute_dtype": "float32", "adamw_lr": 1e-4}
    torch.manual_seed(0)
    reference_model = Net().to(DEVICE).bfloat16()
    torch.manual_seed(0)
    model = _parallelize(Net().to(DEVICE).bfloat16(), mesh)
    reference = lc.Muon(_groups(reference_model), **kwargs)  # to nearest, in one process
    optimizer = lc.Muon(_groups(model), **kwargs, stochastic_rounding=True)
    params = dict(model.named_parameters())
    shapes = {name: p.shape for name, p in reference_model.named_parameters()}
    full = {n: g.bfloat16() for n, g in _gradients(0, shapes).items()}
    for name, param in params.items():
        param.grad = distribute_tensor(full[name], param.device_mesh, param.placements, src_data_rank=None)
    for name, param in reference_model.named_parameters():
        param.grad = full[name]
    before = {name: param.to_local().float().clone() for name, param in params.items()}
    optimizer.step()
    reference.step()
    differ, checked = 0, []
    for name, expected in reference_model.named_parameters():
        actual = params[name]
        local = distribute_tensor(
            expected.detach(), actual.device_mesh, actual.placements, src_data_rank=None
        )
        actual, expected = actual.to_local().float(), local.to_local().float()
        # Rounded up or down from the float32 value of the decay and the step, where nearest
        # rounding rounds each of them: at most a bf16 spacing (2⁻⁷ of the magnitude) of the
        # weight or of the result apart.
        bound = torch.maximum(expected.abs(), before[name].abs()) * 2**-7
        assert bool(((actual - expected).abs() <= bound).all()), name
        differ += int((actual != expected).sum())
        # Replicas over tensor parallelism (the norm, the row-wise layers' biases) round alike.
        param = params[name]
        replicated = param.device_mesh.ndim == 1 or param.placements[-1].is_replicate()
        everyone = [None] * world_size
        torch.distributed.all_gather_object(everyone, (mesh.get_coordinate()[0], actual.cpu()))
        if replicated:
            checked.append(name)
            assert all(
                torch.equal(theirs, actual.cpu()) for dp, theirs in everyone if dp == mesh.get_coordinate()[0]
            )
    assert differ > 0  # it rounded otherwise than to nearest somewhere
    assert {"norm.weight", "down.bias", "experts.weight"} <= set(checked)


def test_stochastic_rounding_under_dp_and_tp_keeps_replicas_equal() -> None:
    run_on_ranks(4, _stochastic_on_dp_and_tp)
