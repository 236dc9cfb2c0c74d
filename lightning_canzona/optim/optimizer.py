"""The base of ``Muon``, ``Shampoo`` and ``SOAP``: one optimizer for matrix and AdamW groups.

Lightning's automatic optimization steps a single optimizer, so the weight matrices and everything
else (embeddings, output head, norms, biases) live in one `torch.optim.Optimizer`. Each param
group carries an ``"algorithm"``: the optimizer's matrix rule (``"muon"``, ``"shampoo"``, ``"soap"``)
or ``"adamw"``. A group given without one is split by dimensionality: tensors with two or more
dimensions take the matrix rule, the rest AdamW. `lightning_canzona.matrix_param_groups`
splits a module more carefully (embeddings and output heads go to AdamW).
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import math
import warnings
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_canzona.distributed.engine import Entry, MeshEngine, entry_rules, mesh_process_group
from lightning_canzona.distributed.failures import raise_on_every_rank
from lightning_canzona.distributed.gradients import agree_on_gradients
from lightning_canzona.distributed.layout import local_tensor, planning_mesh
from lightning_canzona.distributed.teams import TeamPrices, check_team_prices, flops_weights, priced
from lightning_canzona.distributed.updates import apply_matrices, full_direction, prepare_matrices, step_adamw
from lightning_canzona.planning import Plan, PlanSettings
from lightning_canzona.rules.adamw import ALGORITHM as ADAMW
from lightning_canzona.rules.base import MatrixRule
from lightning_canzona.rules.blocks import RowBlockRule, RowBlocks, as_row_blocks, row_block_sizes

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A compute dtype from its name (``"bfloat16"``, ``"float32"``, ``"float64"``) or itself."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"compute_dtype must be one of {sorted(DTYPES)}, got {dtype!r}")


def _check_non_negative(**settings: float) -> None:
    for name, value in settings.items():
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0.0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _check_betas(name: str, betas: tuple[float, float]) -> None:
    if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
        raise ValueError(f"{name} must be two numbers in [0, 1), got {betas!r}")


class MatrixOptimizer(Optimizer):
    """An optimizer whose matrix groups follow a `MatrixRule` and the rest AdamW.

    Subclasses name their algorithm, declare their hyperparameter defaults and build the rule
    from a param group (`matrix_rule`), which is how per-group settings take effect. A matrix
    group may declare ``row_blocks`` (``n`` equal blocks or the blocks' row sizes): its fused
    weights are then updated block by block (`rule_of`, `lightning_canzona.rules.blocks`).

    Args:
        params: Tensors, ``(name, tensor)`` pairs or param-group dicts.
        defaults: Matrix-group hyperparameters (``lr`` and ``weight_decay`` among them).
        adamw_lr: Learning rate of the AdamW groups; ``None`` takes the matrix ``lr``.
        adamw_betas: AdamW's ``(β₁, β₂)``.
        adamw_eps: AdamW's ε.
        adamw_weight_decay: AdamW's decoupled weight decay; ``None`` takes ``weight_decay``.
        check_finite: Raise `FloatingPointError` naming the parameter when a gradient holds
            NaN or Inf, instead of writing it into the weights. Costs one host sync per step.
        stochastic_rounding: Write each step into bf16 parameters rounded up or down at random
            (unbiased), from a float32 computation of the decay and the step, instead of
            rounding each operation to nearest as ``torch.optim`` does: bf16 weights then follow
            updates below their precision on average (`lightning_canzona.rules.rounding`).
            Other dtypes are unaffected.
        policy: Who computes each matrix of DTensor parameters: ``canzona`` (α-balanced owners
            and micro-groups), ``lpt``, ``round_robin`` or ``sync`` (every rank, redundantly).
        alpha: ``canzona``'s balance between per-bucket uniformity (0) and global balance (1).
        cost: What the plan balances: ``flops`` of the updates or ``numel`` of the matrices.
        micro_group_capacity: Largest per-rank cost of one micro-group, in the cost's unit;
            ``None`` derives it from the model.
        max_team: Most ranks that compute one matrix's update together (``canzona``; a power
            of two, 1 keeps every matrix whole): the plan splits the costliest matrices over
            teams where the rule allows (Muon, Shampoo and SOAP: any 2-D matrix) and its cost
            model says it pays.
        team_prices: What the cost model charges for a team's collectives: ``"h100"`` (H100s
            on NVLink within a node and InfiniBand across, in FLOPs of the rule's matrix
            products: `simulation.DeviceModel.plan_prices`), ``"measure"`` (measured on the
            job's own devices and links when the first plan is built, the gathers' and
            scatters' prices too: `distributed.teams.measure_team_costs`), or ``(FLOPs per
            element sent, FLOPs per collective)``.
        overlap: Pipeline the micro-groups: gather the next and scatter the previous group while
            the current one computes.
    """

    #: The value of ``param_groups[i]["algorithm"]`` for the matrix groups.
    algorithm: ClassVar[str]

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
        policy: str = "canzona",
        alpha: float = 0.5,
        cost: str = "flops",
        micro_group_capacity: float | None = None,
        max_team: int = 8,
        team_prices: TeamPrices = "h100",
        overlap: bool = True,
    ) -> None:
        if not isinstance(stochastic_rounding, bool):
            raise TypeError(f"stochastic_rounding must be True or False, got {stochastic_rounding!r}")
        self.adamw_defaults = {
            "lr": defaults["lr"] if adamw_lr is None else adamw_lr,
            "betas": tuple(adamw_betas),
            "eps": adamw_eps,
            "weight_decay": defaults["weight_decay"] if adamw_weight_decay is None else adamw_weight_decay,
            "stochastic_rounding": stochastic_rounding,
        }
        defaults = {**defaults, "stochastic_rounding": stochastic_rounding}
        self.check_finite = check_finite
        self.plan_settings = PlanSettings(
            policy,
            alpha,
            cost,  # type: ignore[arg-type]
            micro_group_capacity,
            max_team=max_team,
        )
        self.team_prices = check_team_prices(team_prices)
        self.overlap = overlap
        #: Batch same-shape matrix updates (see `MeshEngine`); read when an engine is created.
        self.batch_matrices = True
        self.engines: dict[Any, MeshEngine] = {}
        super().__init__(params, defaults)

    @classmethod
    def check_keywords(cls, keywords: Iterable[str]) -> None:
        """Raise a `TypeError` naming this class for a keyword it does not take, with the nearest
        one: the class the user called, not this base, where a subclass's ``**kwargs`` end up.
        (A model that receives an optimizer's settings can check them before any rank starts.)
        """
        own = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "params", "kwargs")]
        shared = [
            name
            for name, parameter in inspect.signature(MatrixOptimizer.__init__).parameters.items()
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY
        ]
        unknown = [name for name in keywords if name not in own + shared]
        if not unknown:
            return
        close = difflib.get_close_matches(unknown[0], own + shared, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise TypeError(
            f"{cls.__name__}() got an unexpected keyword argument {unknown[0]!r}.{hint} It takes: "
            f"{', '.join(own + shared)}."
        )

    @abstractmethod
    def matrix_rule(self, group: dict[str, Any]) -> MatrixRule:
        """The rule for a matrix group, built from the group's hyperparameters."""

    def rule_of(self, group: dict[str, Any]) -> MatrixRule:
        """The rule that updates a matrix group's matrices: `matrix_rule`, applied block by
        block where the group declares ``row_blocks`` (see `lightning_canzona.rules.blocks`)."""
        rule = self.matrix_rule(group)
        spec = group.get("row_blocks")
        return rule if spec is None else RowBlockRule(rule, as_row_blocks(spec))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; without an ``"algorithm"`` it is split into matrix and AdamW groups."""
        if "algorithm" not in param_group:
            params = param_group["params"]
            params = [params] if isinstance(params, Tensor) else list(params)
            by_algorithm: dict[str, list[Any]] = {self.algorithm: [], ADAMW: []}
            for entry in params:
                tensor = entry[1] if isinstance(entry, tuple) else entry
                by_algorithm[self.algorithm if tensor.ndim >= 2 else ADAMW].append(entry)
            for algorithm, members in by_algorithm.items():
                if members:
                    self.add_param_group({**param_group, "params": members, "algorithm": algorithm})
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
            _check_non_negative(lr=group["lr"], weight_decay=group["weight_decay"])
            if algorithm == ADAMW:
                _check_betas("betas", group["betas"])
                _check_non_negative(eps=group["eps"])
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

    def _misplaced_parameter(self, group: dict[str, Any], index: int) -> str | None:
        """Why a parameter of ``group`` cannot be updated by it, or ``None``.

        It reads global shapes only, so every rank finds the same answer before any collective.
        """
        spec = group.get("row_blocks")
        matrices = group["algorithm"] != ADAMW
        for position, param in enumerate(group["params"]):
            placements = f", placements {tuple(param.placements)}" if isinstance(param, DTensor) else ""
            name = _param_name(group, index, position)
            described = f"Parameter {name} of shape {tuple(param.shape)}{placements}"
            if spec is not None and not (matrices and param.ndim >= 2):
                return (
                    f"{described} has row_blocks {spec!r}, but row blocks split matrices (2-D "
                    "weights or stacks of them), and it is in an AdamW group."
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
        """One optimization step; ``closure`` re-evaluates the loss with gradients enabled.

        Every gradient is checked on every rank before any parameter changes (see
        `lightning_canzona.distributed.gradients`); an error in the step's own work is raised on
        every rank once the step's collectives are done.
        """
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
        for group in self.param_groups:
            if group.get("stochastic_rounding"):  # numbers the step's random bits (`StochasticRounding`)
                group["rounding_step"] = group.get("rounding_step", 0) + 1
        present = agree_on_gradients(named, self.check_finite)
        has_grad = {id(param): flag for (_, param), flag in zip(named, present)}
        failure: Exception | None = None
        try:
            self._step_plain_tensors(has_grad, {id(param): name for name, param in named})
        except Exception as error:
            failure = error
        for mesh, entries in self._distributed_entries().items():
            engine = self._engine(mesh)
            engine.step(entries, [has_grad[id(e.param)] for e in entries], self.state, self.rule_of)
            failure = failure or engine.failure
        device = local_tensor(named[0][1]).device
        raise_on_every_rank(failure, device, f"{type(self).__name__}.step")
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
            prepared = prepare_matrices(params, rule, self.state, [True] * len(params))
            directions = [full_direction(rule, p, self.state[param]) for p, param in zip(prepared, params)]
            apply_matrices(params, param_names, rule, directions, group)

    def plans(self) -> dict[Any, Plan]:
        """The plan of every device mesh of the DTensor parameters, built now if need be.

        Collective: every rank must call it (it shares the shards' layouts once).
        """
        return {
            mesh: self._engine(mesh).prepare(entries, self.state, self.rule_of)
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
        """``(param, matrix state)`` of every matrix this rank owns (empty under ``sync``)."""
        held = []
        for engine, rules in self._planned_engines():
            for index, matrix_state in engine.owned_matrix_state(self.state, rules).items():
                held.append((engine._entries[index].param, matrix_state))
        return held

    @contextlib.contextmanager
    def whole_team_state(self) -> Iterator[None]:
        """Within the block, the matrix state of every matrix that a team computes is held whole
        by the team's first member, as checkpoints hold it; after it, in slices again.

        Collective: every rank must enter and leave it together (saving and loading a
        checkpoint do).
        """
        self.gather_team_state()
        try:
            yield
        finally:
            self.scatter_team_state()

    def splits_matrix_state(self) -> bool:
        """Whether a plan has teams whose members hold slices of a matrix's state (Shampoo's
        and SOAP's; Muon's teams hold none)."""
        return any(engine._stateful_team_items(rules) for engine, rules in self._planned_engines())

    def gather_team_state(self) -> None:
        """Put every team's matrix state whole on its first member (collective; see
        `whole_team_state`); the next step or load hands it out again (`scatter_team_state`)."""
        for engine, rules in self._planned_engines():
            engine.gather_team_state(self.state, rules)

    def scatter_team_state(self) -> None:
        """Give every team's members their slices of the state its first member holds whole."""
        for engine, rules in self._planned_engines():
            engine.scatter_team_state(self.state, rules)

    def _planned_engines(self) -> Iterator[tuple[MeshEngine, list[MatrixRule]]]:
        """Every engine that has a plan, with the rules of its matrices."""
        for engine in self.engines.values():
            if engine.plan is not None:
                yield engine, entry_rules(engine._entries, self.rule_of)

    def _distributed_entries(self) -> dict[Any, list[Entry]]:
        """The DTensor parameters by the mesh they are planned on (`planning_mesh`), in
        param-group order (the same on every rank)."""
        distributed: dict[Any, list[Entry]] = {}
        for index, group in enumerate(self.param_groups):
            for position, param in enumerate(group["params"]):
                if isinstance(param, DTensor):
                    entry = Entry(param, group, _param_name(group, index, position).strip("'"))
                    distributed.setdefault(planning_mesh(param.device_mesh), []).append(entry)
        return distributed

    def _engine(self, mesh: Any) -> MeshEngine:
        if mesh not in self.engines:
            group = mesh_process_group(mesh)
            rules = [self.rule_of(g) for g in self.param_groups if g["algorithm"] != ADAMW]
            dtypes = list(dict.fromkeys(rule.matmul_dtype() for rule in rules)) or [torch.float32]
            weights = flops_weights(self.team_prices, group, mesh.device_type, dtypes)
            if weights is None and group.rank() == 0:  # every rank would say the same
                # Matmul FLOPs of different dtypes take different times (float32 about 15× bf16's
                # on an H100), and prices given as figures say nothing of the dtypes' rates.
                warnings.warn(
                    f"The param groups of this {type(self).__name__} multiply in "
                    f"{', '.join(str(d).removeprefix('torch.') for d in dtypes)}, and team_prices are "
                    "given as figures: the plan balances their FLOPs as if equally fast and prices "
                    f"teams' collectives in FLOPs of {str(dtypes[0]).removeprefix('torch.')} (the first "
                    "group's). Use team_prices='h100' or 'measure', or the same compute_dtype in every "
                    "param group, for a balanced plan.",
                    UserWarning,
                    stacklevel=3,
                )
            settings = priced(self.plan_settings, self.team_prices, group, mesh.device_type, dtypes[0])
            self.engines[mesh] = MeshEngine(mesh, settings, self.overlap, self.batch_matrices, weights or {})
        return self.engines[mesh]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load state, keeping each state tensor in the dtype it was saved with.

        ``torch.optim.Optimizer`` casts floating-point state to the parameter's dtype, which would
        truncate float32 Kronecker factors and eigenbases of bf16 parameters.
        """
        super().load_state_dict(state_dict)
        for mesh, entries in self._distributed_entries().items():
            if mesh in self.engines and self.engines[mesh].plan is not None:
                engine = self.engines[mesh]
                engine.prepare(entries, self.state, self.rule_of)  # re-read the new param groups
                rules = entry_rules(engine._entries, self.rule_of)
                engine.scatter_team_state(self.state, rules)
                engine.drop_foreign_matrix_state(self.state, rules)
                engine.keep_loaded_stack_failures_on_one_owner(self.state)
        params = (param for group in self.param_groups for param in group["params"])
        for index, param in enumerate(params):
            for key, saved in state_dict["state"].get(index, {}).items():
                loaded = self.state[param].get(key)
                if isinstance(saved, Tensor) and isinstance(loaded, Tensor) and loaded.dtype != saved.dtype:
                    self.state[param][key] = saved.to(device=loaded.device, copy=True)


def _param_name(group: dict[str, Any], group_index: int, position: int) -> str:
    names = group.get("param_names")
    return repr(names[position]) if names else f"param_groups[{group_index}]['params'][{position}]"
