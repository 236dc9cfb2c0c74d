import copy
import inspect
import math
import sys

import pytest
import torch
from torch import nn

import lightning_canzona as lc
from lightning_canzona.optim import optimizers
from lightning_canzona.rules import MuonRule, NorMuonRule, ShampooRule, SOAPRule
from lightning_canzona.rules.base import non_finite

OPTIMIZERS = [
    (lc.Muon, {"lr": 0.05, "compute_dtype": "float32", "adamw_lr": 1e-2}),
    (lc.Shampoo, {"lr": 1e-2, "precondition_frequency": 2, "start_preconditioning_step": 2}),
    (lc.SOAP, {"lr": 1e-2, "precondition_frequency": 2}),
]


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 32, width: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.up = nn.Linear(width, 2 * width)
        self.norm = nn.LayerNorm(2 * width)
        self.down = nn.Linear(2 * width, width, bias=False)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        hidden = hidden + self.down(torch.relu(self.norm(self.up(hidden))))
        return self.lm_head(hidden)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _train(model, optimizer, batches):
    losses = []
    for tokens in batches:
        optimizer.zero_grad()
        loss = _loss(model, tokens)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def test_matrix_param_groups_send_embeddings_heads_norms_and_biases_to_adamw() -> None:
    groups = lc.matrix_param_groups(TinyLM())
    assert [name for name, _ in groups[0]["params"]] == ["up.weight", "down.weight"]
    assert groups[1]["algorithm"] == "adamw"
    assert [name for name, _ in groups[1]["params"]] == [
        "embed.weight",
        "up.bias",
        "norm.weight",
        "norm.bias",
        "lm_head.weight",
    ]
    overridden = lc.matrix_param_groups(TinyLM(), matrix=["lm_head.*"], elementwise=["down.*"])
    assert [name for name, _ in overridden[0]["params"]] == ["up.weight", "lm_head.weight"]


def test_tied_output_head_is_not_a_matrix() -> None:
    model = TinyLM()
    model.lm_head.weight = model.embed.weight
    model.proj = nn.Linear(24, 32, bias=False)
    model.proj.weight = model.embed.weight
    groups = lc.matrix_param_groups(model)
    assert all(param is not model.embed.weight for _, param in groups[0]["params"])


@pytest.mark.parametrize("optimizer_class, kwargs", OPTIMIZERS)
def test_one_optimizer_runs_matrix_and_adamw_groups(optimizer_class, kwargs) -> None:
    model = TinyLM()
    optimizer = optimizer_class(lc.matrix_param_groups(model), **kwargs)
    assert [group["algorithm"] for group in optimizer.param_groups] == [optimizer_class.algorithm, "adamw"]
    batches = [torch.randint(0, 32, (8, 17)) for _ in range(40)]
    losses = _train(model, optimizer, batches[:1] * 40)
    assert losses[-1] < 0.5 * losses[0]  # it learns the batch
    embed_state = optimizer.state[model.embed.weight]
    assert set(embed_state) == {"step", "exp_avg", "exp_avg_sq"}


def test_adamw_groups_match_torch_adamw() -> None:
    model = TinyLM()
    reference = copy.deepcopy(model)
    settings = dict(lr=3e-3, betas=(0.9, 0.98), eps=1e-7, weight_decay=0.05)
    ours = lc.Muon([{"params": model.parameters(), "algorithm": "adamw", **settings}])
    theirs = torch.optim.AdamW(reference.parameters(), **settings)
    batches = [torch.randint(0, 32, (4, 9)) for _ in range(4)]
    _train(model, ours, batches)
    _train(reference, theirs, batches)
    for mine, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, expected, rtol=0, atol=0)


def test_plain_parameters_are_split_by_dimensionality() -> None:
    model = TinyLM()
    optimizer = lc.Muon(model.parameters())
    matrix, adamw = optimizer.param_groups
    assert all(p.ndim >= 2 for p in matrix["params"]) and matrix["algorithm"] == "muon"
    assert all(p.ndim < 2 for p in adamw["params"]) and adamw["algorithm"] == "adamw"
    assert adamw["lr"] == matrix["lr"] and adamw["eps"] == 1e-8 and adamw["betas"] == (0.9, 0.95)


def test_float32_matrix_state_and_counters_survive_loading_for_bf16_parameters() -> None:
    param = nn.Parameter(torch.randn(16, 24, dtype=torch.bfloat16))
    bias = nn.Parameter(torch.zeros(24, dtype=torch.bfloat16))
    optimizer = lc.SOAP([param, bias])
    param.grad, bias.grad = torch.randn_like(param), torch.randn_like(bias)
    optimizer.step()
    optimizer.state[param]["step"] = 257  # not a bf16 number: a cast to the parameter's dtype shows
    state = optimizer.state_dict()
    # Counters are Python numbers while running, 0-dim tensors in a state dict, as always saved.
    assert type(optimizer.state[param]["step"]) is int and type(optimizer.state[bias]["step"]) is float
    saved = state["state"]
    assert saved[0]["step"].dtype == saved[0]["decomposition_failures"].dtype == torch.int64
    assert saved[0]["step"].shape == () and saved[1]["step"].dtype == torch.float32
    fresh = lc.SOAP([param, bias])
    fresh.load_state_dict(state)
    assert fresh.state[param]["left"].dtype == torch.float32
    assert torch.equal(fresh.state[param]["left"], optimizer.state[param]["left"])
    loaded = fresh.state[param]
    assert (loaded["step"], loaded["decomposition_failures"], fresh.state[bias]["step"]) == (257, 0, 1.0)
    assert type(loaded["step"]) is int and type(fresh.state[bias]["step"]) is float


def test_parameters_without_gradients_are_left_alone() -> None:
    model = TinyLM()
    optimizer = lc.Shampoo(lc.matrix_param_groups(model))
    before = model.up.weight.detach().clone()
    for param in model.parameters():
        param.grad = None if param is model.up.weight else torch.randn_like(param)
    optimizer.step()
    assert torch.equal(model.up.weight, before) and model.up.weight not in optimizer.state


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda p: lc.Muon(p, lr=-1.0),
            r"param_groups\[0\] \(muon\): lr must be a finite number >= 0, got -1.0",
        ),
        (lambda p: lc.Muon(p, ns_steps=0), r"ns_steps must be an integer >= 1, got 0"),
        (lambda p: lc.Muon(p, ns_coefficients="cubic"), r"Unknown ns_coefficients preset 'cubic'"),
        (lambda p: lc.Muon(p, adjust_lr_fn="sqrt"), r"adjust_lr_fn must be one of"),
        (lambda p: lc.Muon(p, compute_dtype="float16"), r"compute_dtype must be 'auto' or one of"),
        (lambda p: lc.Muon(p, momentum=1.0), r"momentum must lie in \[0, 1\)"),
        (
            lambda p: lc.Shampoo(p, precondition_frequency=0),
            r"precondition_frequency must be an integer >= 1",
        ),
        (lambda p: lc.SOAP(p, betas=(0.9, 1.5)), r"betas must be two numbers in \[0, 1\)"),
        (lambda p: lc.Muon(p, adamw_betas=(1.0, 0.9)), r"param_groups\[1\] \(adamw\): betas must be"),
    ],
)
def test_bad_settings_are_named(build, message) -> None:
    with pytest.raises(ValueError, match=message):
        build(lc.matrix_param_groups(TinyLM()))


@pytest.mark.parametrize("optimizer_class", [lc.Muon, lc.NorMuon, lc.Shampoo, lc.SOAP])
def test_each_signature_declares_its_rules_settings_and_groups_hold_them(optimizer_class) -> None:
    # A setting is declared once, on the rule; the signature repeats it for IDEs and LightningCLI
    # (with lr and weight_decay, which the rule's apply takes), and a group holds its defaults.
    parameters = inspect.signature(optimizer_class.__init__).parameters
    skipped = ("self", "params", "qk_clip", "kwargs")
    declared = {name: p.default for name, p in parameters.items() if name not in skipped}
    settings = optimizer_class.rule.settings()
    assert declared.keys() == {"lr", "weight_decay", *settings}
    assert {name: declared[name] for name in settings} == settings
    optimizer = optimizer_class([nn.Parameter(torch.zeros(4, 4))])
    assert {name: optimizer.param_groups[0][name] for name in declared} == declared


def test_normuon_is_muon_with_beta2() -> None:
    muon = list(inspect.signature(lc.Muon.__init__).parameters.values())
    normuon = list(inspect.signature(lc.NorMuon.__init__).parameters.values())
    assert [parameter for parameter in normuon if parameter.name != "beta2"] == muon
    assert issubclass(lc.NorMuon, lc.Muon) and issubclass(lc.NorMuon.rule, lc.Muon.rule)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: MuonRule(momentum=1.0), r"momentum must lie in \[0, 1\)"),
        (lambda: NorMuonRule(beta2=1.0), r"beta2 must lie in \[0, 1\)"),
        (lambda: ShampooRule(epsilon_mode="ridge"), r"epsilon_mode must be one of"),
        (lambda: SOAPRule(betas=(0.9, 1.0)), r"betas must be two numbers in \[0, 1\)"),
    ],
)
def test_a_rule_checks_its_settings_when_built_directly(build, message) -> None:
    with pytest.raises(ValueError, match=message):
        build()


def test_a_muon_step_calls_nothing_of_the_optimizer_classes_module() -> None:
    # The rule reads its settings from the group itself: the classes only build the optimizer.
    model = TinyLM()
    optimizer = lc.Muon(lc.matrix_param_groups(model))
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    called = set()
    sys.setprofile(lambda frame, event, arg: called.add(frame.f_code.co_filename))
    try:
        optimizer.step()
    finally:
        sys.setprofile(None)
    assert inspect.getfile(lc.Muon.step) in called and optimizers.__file__ not in called


def test_a_vector_forced_into_a_matrix_group_is_named() -> None:
    model = TinyLM()
    with pytest.raises(ValueError, match=r"Parameter 'up.bias' of shape \(48,\) is in a 'muon' group"):
        lc.Muon(
            [{"params": [("up.weight", model.up.weight), ("up.bias", model.up.bias)], "algorithm": "muon"}]
        )
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\] of shape \(48,\)"):
        lc.SOAP([{"params": [model.up.bias], "algorithm": "soap"}])
    with pytest.raises(ValueError, match="has algorithm 'lion'"):
        lc.Muon([{"params": [model.up.weight], "algorithm": "lion"}])


def test_non_finite_flags_each_tensor_that_holds_nan_or_inf() -> None:
    tensors = [
        torch.tensor([1.0, math.nan]),
        torch.tensor([-math.inf, 1.0]),  # the largest magnitude, not the largest value
        torch.tensor([3e38, -3e38]),  # finite, though a sum or a norm of squares would overflow
        torch.empty(0),  # a rank's empty shard
        torch.tensor([1e300], dtype=torch.float64),  # beyond float32, finite
        torch.tensor([math.inf], dtype=torch.bfloat16),
        torch.ones(2, 3, dtype=torch.bfloat16),
    ]
    assert non_finite(tensors).tolist() == [True, True, False, False, False, True, False]
    assert non_finite([]).tolist() == [] and non_finite([torch.empty(0)]).tolist() == [False]


@pytest.mark.parametrize("optimizer_class, kwargs", OPTIMIZERS)
def test_non_finite_gradient_is_named_and_nothing_is_written(optimizer_class, kwargs) -> None:
    model = TinyLM()
    optimizer = optimizer_class(lc.matrix_param_groups(model), **kwargs)
    before = copy.deepcopy(model.state_dict())
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    model.down.weight.grad[3, 4] = float("nan")
    with pytest.raises(
        FloatingPointError, match=r"parameter 'down.weight' \(shape \(24, 48\)\) holds NaN or Inf"
    ):
        optimizer.step()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_the_plan_is_set_in_one_place_never_overwritten_silently() -> None:
    from lightning_canzona.optim.binding import bind_optimizer

    model = nn.Linear(4, 4)
    lpt = lc.PlanConfig(policy="lpt", overlap=False)
    own = lc.Muon(lc.matrix_param_groups(model))
    assert bind_optimizer(own, model, lpt) == (own, None) and own.plan_config == lpt  # none of its own
    given = lc.Muon(lc.matrix_param_groups(model), plan=lc.PlanConfig(max_team=1))
    bind_optimizer(given, model, None)  # the strategy sets none: the optimizer keeps its own
    assert given.plan_config == lc.PlanConfig(max_team=1)
    bind_optimizer(given, model, lc.PlanConfig(max_team=1))  # the same in both places
    with pytest.raises(ValueError, match=r"max_team: 8 on CanzonaStrategy, 1 on Muon"):
        bind_optimizer(given, model, lc.PlanConfig())
    converted, said = bind_optimizer(torch.optim.Muon([model.weight]), model, lpt)
    assert isinstance(converted, lc.Muon) and converted.plan_config == lpt and "converted" in said
    # What the engine plans with is the config's.
    assert own.plan_settings().policy == "lpt" and given.plan_settings().max_team == 1
    with pytest.raises(TypeError, match=r"plan=PlanConfig\(alpha=\.\.\.\)"):
        lc.SOAP(lc.matrix_param_groups(model), alpha=0.3)
    with pytest.raises(TypeError, match="plan must be a lightning_canzona.PlanConfig"):
        lc.Muon(lc.matrix_param_groups(model), plan={"policy": "lpt"})
    assert lc.PlanConfig(team_prices=[1, 2]).team_prices == (1.0, 2.0)  # as a YAML list reads
    bad_settings = (
        ({"team_prices": "a100"}, "team_prices must be"),
        ({"max_team": 3}, "max_team"),
        ({"replicas": "both"}, "replicas must be one of"),
    )
    for bad, message in bad_settings:
        with pytest.raises(ValueError, match=message):
            lc.PlanConfig(**bad)
