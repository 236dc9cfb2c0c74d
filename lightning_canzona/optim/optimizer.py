"""The base of the optimizers: matrix groups by a `MatrixRule`, the rest by AdamW, in one optimizer."""

from __future__ import annotations

import contextlib
import difflib
import inspect
import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import fields, replace
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_canzona.config import PlanConfig
from lightning_canzona.distributed.agreement import GradientAgreement
from lightning_canzona.distributed.engine import MeshEngine
from lightning_canzona.distributed.layout import local_tensor, planning_mesh
from lightning_canzona.distributed.runtime import (
    Entry,
    apply_matrices,
    full_direction,
    prepare_matrices,
    step_adamw,
)
from lightning_canzona.planning import Plan, PlanSettings
from lightning_canzona.qk_clip.settings import QKClip
from lightning_canzona.rules import counters
from lightning_canzona.rules.adamw import ALGORITHM as ADAMW
from lightning_canzona.rules.base import MatrixRule, check_betas, check_non_negative, check_state_dtype
from lightning_canzona.rules.blocks import RowBlockRule, RowBlocks, as_row_blocks, row_block_sizes

#: The settings of `PlanConfig`, which the optimizers take as ``plan=PlanConfig(...)``.
PLAN_FIELDS = frozenset(f.name for f in fields(PlanConfig))


class MatrixOptimizer(Optimizer):
    """An optimizer whose matrix groups follow a `MatrixRule` (`rule`, `matrix_rule`) and the rest AdamW.

    Args:
        params: Tensors, ``(name, tensor)`` pairs or param-group dicts.
        defaults: Matrix-group hyperparameters (``lr`` and ``weight_decay`` among them).
        adamw_lr: Learning rate of the AdamW groups; ``None`` takes the matrix ``lr``.
        adamw_betas: AdamW's ``(β₁, β₂)``.
        adamw_eps: AdamW's ε.
        adamw_weight_decay: AdamW's decoupled weight decay; ``None`` takes ``weight_decay``.
        check_finite: Raise `FloatingPointError`, naming the parameter, for a NaN or Inf gradient.
        stochastic_rounding: Round each step into bf16 parameters stochastically (unbiased).
        state_dtype: ``"bfloat16"`` keeps the momentum and Adam's and SOAP's moments of float32
            parameters in bf16 (each step computes in float32 and rounds them once), ``None`` in
            each parameter's dtype. Factors, bases and Shampoo's state stay float32.
        plan: How DTensor parameters' updates are planned (`PlanConfig`); ``None``: the strategy's.
    """

    #: The value of ``param_groups[i]["algorithm"]`` for the matrix groups.
    algorithm: ClassVar[str]
    #: The rule class of the matrix groups, which the default `matrix_rule` builds.
    rule: ClassVar[type[MatrixRule]]

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
        check_finite: bool = True,
        stochastic_rounding: bool = False,
        state_dtype: str | None = None,
        plan: PlanConfig | None = None,
    ) -> None:
        if not isinstance(stochastic_rounding, bool):
            raise TypeError(f"stochastic_rounding must be True or False, got {stochastic_rounding!r}")
        check_state_dtype(state_dtype)
        rates = {"lr": defaults["lr"], "adamw_lr": adamw_lr}  # a tensor's shape before params, as torch.optim
        check_non_negative(**{name: rate for name, rate in rates.items() if isinstance(rate, Tensor)})
        if adamw_lr is None:  # a tensor of its own: a scheduler writes each group's in place
            adamw_lr = defaults["lr"].clone() if isinstance(defaults["lr"], Tensor) else defaults["lr"]
        self.adamw_defaults = {
            "lr": adamw_lr,
            "betas": tuple(adamw_betas),
            "eps": adamw_eps,
            "weight_decay": defaults["weight_decay"] if adamw_weight_decay is None else adamw_weight_decay,
            "stochastic_rounding": stochastic_rounding,
            "state_dtype": state_dtype,
        }
        defaults = {**defaults, "stochastic_rounding": stochastic_rounding, "state_dtype": state_dtype}
        self.check_finite = check_finite
        #: How the DTensor parameters' matrix updates are planned and run.
        self.plan_config = PlanConfig.given(plan) or PlanConfig()
        self._plan_config_given = plan is not None
        #: Batch same-shape matrix updates, and plan with locality (see `MeshEngine`): the
        #: baselines of ``canzona bench step`` turn them off; read when an engine is created.
        self.batch_matrices = True
        self.locality = True
        #: Ranks per node (consecutive global ranks share one), which prices a plan's gathers
        #: and scatters within or across nodes; the strategies set it, ``None``: torchrun's
        #: ``LOCAL_WORLD_SIZE``, else one node. Read when an engine is created.
        self.devices_per_node: int | None = None
        self.engines: dict[Any, MeshEngine] = {}
        #: QK-clip's setting (`Muon` and `NorMuon` take it) and, once a strategy or
        #: `lightning_canzona.qk_clip_runtime.attach_qk_clip` has attached it to the model, its runtime.
        self.qk_clip: QKClip | None = None
        self.qk_clip_runtime: Any = None
        #: The ranks' agreement on this optimizer's gradients, and the checks that wait for it.
        self.agreement = GradientAgreement()
        super().__init__(params, defaults)

    @classmethod
    def check_keywords(cls, keywords: Iterable[str]) -> None:
        """Raise a `TypeError` naming this class and the nearest keyword for one it does not take."""
        own = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "params", "kwargs")]
        shared = [
            name
            for name, parameter in inspect.signature(MatrixOptimizer.__init__).parameters.items()
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY
        ]
        unknown = [name for name in keywords if name not in own + shared]
        if not unknown:
            return
        if unknown[0] in PLAN_FIELDS:
            raise TypeError(
                f"{cls.__name__}() got an unexpected keyword argument {unknown[0]!r}: it is a setting of "
                f"the plan, given as {cls.__name__}(params, plan=PlanConfig({unknown[0]}=...)) or on the "
                "strategy (lightning_canzona.PlanConfig)."
            )
        close = difflib.get_close_matches(unknown[0], own + shared, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise TypeError(
            f"{cls.__name__}() got an unexpected keyword argument {unknown[0]!r}.{hint} It takes: "
            f"{', '.join(own + shared)}."
        )

    def adopt_plan_config(self, config: PlanConfig, source: str) -> None:
        """Take the strategy ``source``'s ``config`` as this optimizer's plan configuration.

        Raises `ValueError` if this optimizer was given a different one, `RuntimeError` once it planned.
        """
        if config == self.plan_config:
            return
        if self._plan_config_given:
            name, own = type(self).__name__, self.plan_config
            differ = "; ".join(
                f"{field}: {getattr(config, field)!r} on {source}, {getattr(own, field)!r} on {name}"
                for field in config.differences(own)
            )
            raise ValueError(
                f"{source}(plan=...) and {name}(plan=...) differ ({differ}). Give "
                "plan=PlanConfig(...) to one of them only: the strategy's applies to every optimizer "
                "that sets none of its own."
            )
        if self.engines:
            raise RuntimeError(
                f"{type(self).__name__} has planned its step already; it cannot adopt {source}'s plan."
            )
        self.plan_config = config

    def matrix_rule(self, group: dict[str, Any]) -> MatrixRule:
        """The rule for a matrix group, built from its settings (`MatrixRule.from_group` of `rule`)."""
        return self.rule.from_group(group)

    def rule_of(self, group: dict[str, Any]) -> MatrixRule:
        """The rule of a matrix group: `matrix_rule`, block by block where it declares ``row_blocks``."""
        rule = self.matrix_rule(group)
        spec = group.get("row_blocks")
        return rule if spec is None else RowBlockRule(rule, as_row_blocks(spec))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group, split into matrix and AdamW groups without an ``"algorithm"``, and name it."""
        if "algorithm" not in param_group:
            params = param_group["params"]
            params = [params] if isinstance(params, Tensor) else list(params)
            by_algorithm: dict[str, list[Any]] = {self.algorithm: [], ADAMW: []}
            for entry in params:
                tensor = entry[1] if isinstance(entry, tuple) else entry
                by_algorithm[self.algorithm if tensor.ndim >= 2 else ADAMW].append(entry)
            parts = {algorithm: members for algorithm, members in by_algorithm.items() if members}
            for algorithm, members in parts.items():
                part = {**param_group, "params": members, "algorithm": algorithm}
                if "name" in param_group and len(parts) > 1:
                    part["name"] = f"{param_group['name']}-{algorithm}"
                self.add_param_group(part)
            return
        algorithm = param_group["algorithm"]
        index = len(self.param_groups)
        if algorithm == ADAMW:
            param_group = {**self.adamw_defaults, **param_group}
        elif algorithm != self.algorithm:
            raise ValueError(
                f"param_groups[{index}] has algorithm {algorithm!r}; {type(self).__name__} runs "
                f"{self.algorithm!r} and {ADAMW!r} groups"
            )
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            check_non_negative(lr=group["lr"], weight_decay=group["weight_decay"])
            check_state_dtype(group.get("state_dtype"))
            if algorithm == ADAMW:
                check_betas("betas", group["betas"])
                check_non_negative(eps=group["eps"])
            else:
                self.matrix_rule(group)
        except ValueError as error:
            self.param_groups.pop()
            raise ValueError(f"param_groups[{index}] ({algorithm}): {error}") from None
        misplaced = self._misplaced_parameter(group, index)
        if misplaced is not None:
            self.param_groups.pop()
            raise ValueError(misplaced)
        if "row_blocks" in group:
            group["row_blocks"] = as_row_blocks(group["row_blocks"])
        if "name" not in group:
            taken = {other.get("name") for other in self.param_groups}
            names = itertools.chain([algorithm], (f"{algorithm}-{n}" for n in itertools.count(2)))
            group["name"] = next(name for name in names if name not in taken)

    def _misplaced_parameter(self, group: dict[str, Any], index: int) -> str | None:
        """Why a parameter of ``group`` cannot be updated by it, or ``None``; from global shapes alone."""
        spec = group.get("row_blocks")
        matrices = group["algorithm"] != ADAMW
        for position, param in enumerate(group["params"]):
            placements = f", placements {tuple(param.placements)}" if isinstance(param, DTensor) else ""
            name = _param_name(group, index, position)
            described = f"Parameter {name} of shape {tuple(param.shape)}{placements}"
            if param.is_complex():
                return (
                    f"{described} is complex ({param.dtype}), and {type(self).__name__} updates real "
                    "parameters only (torch.optim.Muon refuses complex ones too). Leave it out, or "
                    "give it to an optimizer for complex numbers (torch.optim.AdamW)."
                )
            if spec is not None and not (matrices and param.ndim in (2, 3)):
                where = "it is in an AdamW group" if not matrices else f"it has {param.ndim} dimensions"
                return (
                    f"{described} has row_blocks {spec!r}, but row blocks split matrices (2-D "
                    f"weights or stacks of them), and {where}."
                )
            if matrices and param.ndim < 2:
                return (
                    f"{described} is in a {self.algorithm!r} group, but matrix "
                    "rules need 2-D weights or stacks of them. Put it in an AdamW group "
                    "({'params': [...], 'algorithm': 'adamw'}) or build the groups with "
                    "lightning_canzona.matrix_param_groups(model)."
                )
            if spec is not None:
                try:
                    row_block_sizes(spec, param.shape[-2])
                except ValueError as error:
                    return f"{described} has row_blocks {spec!r}: {error}."
        return None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimization step; an error on any rank is raised on every rank before anything changes."""
        if self.qk_clip is not None and self.qk_clip_runtime is None:  # the same on every rank
            raise RuntimeError(
                f"{type(self).__name__}(qk_clip=...) needs the model's attention layers: train with "
                "strategy='canzona' (Trainer or Fabric), or call "
                "lightning_canzona.attach_qk_clip(model, optimizer) before the first step."
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        named = [
            (_param_name(group, index, position).strip("'"), param)
            for index, group in enumerate(self.param_groups)
            for position, param in enumerate(group["params"])
        ]
        if not named:
            return loss
        sparse = next(
            ((n, p.grad.layout) for n, p in named if p.grad is not None and p.grad.layout != torch.strided),
            None,
        )
        if sparse is not None:  # a layout: the same on every rank, read without the device
            raise RuntimeError(
                f"{type(self).__name__} does not support sparse gradients: parameter {sparse[0]!r} has a "
                f"{sparse[1]} gradient (nn.Embedding(sparse=True) makes them). Build it with "
                "sparse=False, or give it to torch.optim.SparseAdam."
            )
        for group in self.param_groups:
            if group.get("stochastic_rounding"):  # numbers the step's random bits (`StochasticRounding`)
                group["rounding_step"] = group.get("rounding_step", 0) + 1
        present = self.agreement.agree_for_step(named, self.check_finite)
        has_grad = {id(param): flag for (_, param), flag in zip(named, present)}
        failure: Exception | None = None
        try:
            self._step_plain_tensors(has_grad, {id(param): name for name, param in named})
        except Exception as error:
            failure = error
        for mesh, entries in self._distributed_entries().items():
            engine = self._engine(mesh)
            engine.step(entries, [has_grad[id(e.param)] for e in entries], self.state)
            failure = failure or engine.failure
        device = local_tensor(named[0][1]).device
        self.agreement.raise_on_every_rank(failure, device, f"{type(self).__name__}.step")
        return loss

    def _step_plain_tensors(self, has_grad: dict[int, bool], names: dict[int, str]) -> None:
        """Update the parameters that are not DTensors: whole, on this rank."""
        for group in self.param_groups:
            params = [p for p in group["params"] if not isinstance(p, DTensor) and has_grad[id(p)]]
            if not params:
                continue
            param_names = [names[id(param)] for param in params]
            if group["algorithm"] == ADAMW:
                step_adamw(params, param_names, self.state, group)
                continue
            rule = self.rule_of(group)
            prepared = prepare_matrices(
                params, rule, self.state, [True] * len(params), group.get("state_dtype")
            )
            directions = [full_direction(rule, p, self.state[param]) for p, param in zip(prepared, params)]
            apply_matrices(params, param_names, rule, directions, group)

    def plans(self) -> dict[Any, Plan]:
        """The plan of every device mesh of the DTensor parameters, built now if need be (collective)."""
        return {
            mesh: self._engine(mesh).prepare(entries, self.state)
            for mesh, entries in self._distributed_entries().items()
        }

    def row_blocks(self) -> dict[str, RowBlocks]:
        """The declared ``row_blocks`` of every matrix updated block by block, by parameter name."""
        return {
            _param_name(group, index, position).strip("'"): group["row_blocks"]
            for index, group in enumerate(self.param_groups)
            if "row_blocks" in group
            for position in range(len(group["params"]))
        }

    def owner_held_state(self) -> list[tuple[Tensor, dict[str, Tensor]]]:
        """``(param, matrix state)`` of every matrix this rank owns, counters as tensors."""
        return [
            (param, counters.saved(matrix_state))
            for engine in self.engines.values()
            for param, matrix_state in engine.owned_state(self.state)
        ]

    @contextlib.contextmanager
    def whole_team_state(self) -> Iterator[None]:
        """Within the block, each team's matrix state is whole on its first member (collective)."""
        self.agreement.settle()
        self.gather_team_state()
        try:
            yield
        finally:
            self.scatter_team_state()

    def splits_matrix_state(self) -> bool:
        """Whether a plan has teams whose members hold slices of a matrix's state."""
        return any(engine.splits_matrix_state(self.state) for engine in self.engines.values())

    def gather_team_state(self) -> None:
        """Put every team's matrix state whole on its first member (collective)."""
        for engine in self.engines.values():
            engine.gather_team_state(self.state)

    def scatter_team_state(self) -> None:
        """Give every team's members their slices of the state its first member holds whole."""
        for engine in self.engines.values():
            engine.scatter_team_state(self.state)

    def _distributed_entries(self) -> dict[Any, list[Entry]]:
        """The DTensor parameters by planning mesh, in param-group order, each with its group's rule."""
        distributed: dict[Any, list[Entry]] = {}
        for index, group in enumerate(self.param_groups):
            rule = None
            for position, param in enumerate(group["params"]):
                if isinstance(param, DTensor):
                    if rule is None and group["algorithm"] != ADAMW:
                        rule = self.rule_of(group)
                    entry = Entry(param, group, _param_name(group, index, position).strip("'"), rule)
                    distributed.setdefault(planning_mesh(param.device_mesh), []).append(entry)
        return distributed

    def plan_settings(self) -> PlanSettings:
        """The planner's settings from `plan_config`, before team prices, with `locality`."""
        return replace(self.plan_config.settings(), locality=self.locality)

    def reserve_step_buffers(self) -> None:
        """Reserve each mesh's step arena (`MeshEngine.reserve`) before the agreement's read, which
        then tells every rank that one could not: the step raises before its first exchange."""
        for engine in self.engines.values():
            failure = engine.reserve()
            self.agreement.raise_on_every_rank(failure, engine.device, f"{type(self).__name__}.step")

    def _engine(self, mesh: Any) -> MeshEngine:
        if mesh not in self.engines:
            self.agreement.before_read = self.reserve_step_buffers
            rules = [self.rule_of(g) for g in self.param_groups if g["algorithm"] != ADAMW]
            self.engines[mesh] = MeshEngine(
                mesh,
                self.plan_config,
                rules,
                self.plan_settings(),
                self.batch_matrices,
                self.devices_per_node,
                type(self).__name__,
            )
        return self.engines[mesh]

    def __getstate__(self) -> dict[str, Any]:
        """Every attribute but the hooks; a `TypeError` once planned over a process group or clipping."""
        bound = "planned its step over a process group" if self.engines else None
        if self.qk_clip_runtime is not None:
            bound = "QK-clip attached to a model's attention layers"
        if bound is not None:
            name = type(self).__name__
            raise TypeError(
                f"A {name} that has {bound} cannot be copied or pickled: the copy would share them. "
                f"Build a new {name} on the parameters and load this one's state into it "
                "(new.load_state_dict(optimizer.state_dict()))."
            )
        hooks = [name for name in vars(self) if name.startswith("_optimizer_") and name.endswith("_hooks")]
        return {key: value for key, value in vars(self).items() if key not in hooks}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """torch's, without the ``differentiable`` default it adds."""
        declared = "differentiable" in state.get("defaults", getattr(self, "defaults", {}))
        super().__setstate__(state)
        if not declared:
            self.defaults.pop("differentiable", None)

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Optimizer.state_dict``, with each counter a 0-dim tensor."""
        state_dict = super().state_dict()
        state_dict["state"] = {
            key: counters.saved(state) if isinstance(state, dict) else state
            for key, state in state_dict["state"].items()
        }
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load state, each tensor in the dtype it was saved with, each counter a Python number."""
        names = [group.get("name") for group in self.param_groups]
        super().load_state_dict(state_dict)
        # Each counter from the state dict's (host) tensor, its parameter found as torch finds
        # it: by the order of the groups' parameters (ids, or names from torch.distributed.checkpoint).
        by_param = {key: state for key, state in state_dict["state"].items() if isinstance(state, dict)}
        saved_ids = (key for group in state_dict["param_groups"] for key in group["params"])
        params = (param for group in self.param_groups for param in group["params"])
        for key, param in zip(saved_ids, params):
            for name, saved in by_param.get(key, {}).items():
                if counters.is_counter(name):
                    self.state[param][name] = counters.number(saved)
        for group, name in zip(
            self.param_groups, names
        ):  # saved without names: keep ours, as torch keeps param_names
            if name is not None:
                group.setdefault("name", name)
        for group in self.param_groups:  # a setting added since the save takes its default
            defaults = self.adamw_defaults if group.get("algorithm") == ADAMW else self.defaults
            for key, value in defaults.items():
                group.setdefault(key, value)
            if "compile" in defaults:  # how this run computes, not how the saved one did
                group["compile"] = defaults["compile"]
        for mesh, entries in self._distributed_entries().items():
            if mesh in self.engines:
                self.engines[mesh].load_state(entries, self.state)
        params = (param for group in self.param_groups for param in group["params"])
        for index, param in enumerate(params):
            for key, saved in by_param.get(index, {}).items():
                loaded = self.state[param].get(key)
                if isinstance(saved, Tensor) and isinstance(loaded, Tensor) and loaded.dtype != saved.dtype:
                    self.state[param][key] = saved.to(device=loaded.device, copy=True)


def _param_name(group: dict[str, Any], group_index: int, position: int) -> str:
    names = group.get("param_names")
    return repr(names[position]) if names else f"param_groups[{group_index}]['params'][{position}]"
