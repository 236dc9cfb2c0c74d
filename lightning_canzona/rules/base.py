"""The contract of a matrix update rule (`MatrixRule`), and the cost it reports (`UpdateCost`).

A rule splits a step in three: `MatrixRule.prepare` (elementwise, on shards), `MatrixRule.direction`
(the whole matrix, on its owner) and `MatrixRule.apply` (elementwise, on shards). Below the
contract: writing updates into parameters (`scale_`, `StochasticRounding`) and IEEE float32
products under TF32 (`ieee_float32_products`). docs/own-optimizer.md and docs/optimizers.md
explain them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor

from lightning_canzona.compat import foreach_add_, foreach_mul_, foreach_norm

State = dict[str, Tensor]

#: The state key counting the factor decompositions that failed (see
#: `lightning_canzona.rules.kronecker.decompose`): one count per parameter, which every part of
#: its state kept under a prefix shares.
FAILURES = "decomposition_failures"

#: The ``state_dtype`` settings: elementwise state (momentum, Adam's moments) kept in another dtype
#: than its parameter's. ``None`` keeps the parameter's dtype, as ``torch.optim`` does.
STATE_DTYPES = {"bfloat16": torch.bfloat16}


def check_state_dtype(value: object) -> None:
    """A `ValueError` naming the setting unless ``value`` is a ``state_dtype``."""
    if value is not None and value not in STATE_DTYPES:
        raise ValueError(
            f"state_dtype must be None (each parameter's dtype, as torch.optim) or one of "
            f"{sorted(STATE_DTYPES)}, got {value!r}"
        )


#: The retry counter of the computation running in this context (`counting_retries`).
_RETRIES: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("retries", default=None)


@contextlib.contextmanager
def counting_retries() -> Iterator[Callable[[], int]]:
    """Count, inside the block, the decompositions that failed in float32 and were computed again
    in float64 (`note_retry`); yields what reads the count."""
    count = [0]
    token = _RETRIES.set(count)
    try:
        yield lambda: count[0]
    finally:
        _RETRIES.reset(token)


def note_retry() -> None:
    """Count a retried decomposition for the enclosing `counting_retries`, if any."""
    count = _RETRIES.get()
    if count is not None:
        count[0] += 1


def state_part(state: State, prefix: str) -> State:
    """The part of ``state`` under ``prefix`` (prefix removed), with the shared failure count."""
    part = {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}
    if FAILURES in state:
        part[FAILURES] = state[FAILURES]
    return part


def store_state_part(state: State, prefix: str, part: State) -> None:
    """Write ``part`` back under ``prefix``: a rule may replace a tensor, not only update it."""
    for key, value in part.items():
        state[key if key == FAILURES else prefix + key] = value


@dataclass(frozen=True)
class TeamSum:
    """A partial result that a team's members add up; each receives the sum."""

    tensor: Tensor


def summed_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a team adds `TeamSum` tensors of ``dtype`` in: float32 for half precision."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


@dataclass(frozen=True)
class TeamRows:
    """This member's rows (dim -2) of a matrix the members hold in turn; each receives the whole."""

    tensor: Tensor
    sizes: tuple[int, ...]


TeamRequest = TeamSum | TeamRows
#: A team computation (`MatrixRule.team_direction`) yields the requests of one round at a time,
#: receives their combinations (in the same order) and returns the member's result.
TeamComputation = Generator[tuple[TeamRequest, ...], tuple[Tensor, ...], Tensor]


@dataclass(frozen=True)
class UpdateCost:
    """What one step of a rule costs for one matrix (or stack) of a given shape.

    Attributes:
        flops: FLOPs of `MatrixRule.direction` per step, periodic work amortised.
        numel: Elements of the matrix: what a gather or scatter moves.
        matrix_state_bytes: Bytes of state held by the matrix's owner.
        elementwise_state_bytes: Bytes of state held beside the shards, over all shards.
        team_messages: Collectives among a team's members per step (0 for a whole matrix).
        team_numel: Elements each team member sends per step, in the rule's matmul dtype.
        member_flops: FLOPs single team members carry on top of ``flops``, in member order.
        period: Steps between runs of the periodic work (decompositions); 1: none.
        periodic_flops: Each member's FLOPs of that work on a step that runs it.
        working_bytes: The rule's own temporaries for one update at their peak (a member's, in a
            team), beside its input and its output: what the step's memory model adds per matrix.
    """

    flops: float
    numel: int
    matrix_state_bytes: int
    elementwise_state_bytes: int
    team_messages: int = 0
    team_numel: int = 0
    member_flops: tuple[float, ...] = ()
    period: int = 1
    periodic_flops: tuple[float, ...] = ()
    working_bytes: int = 0

    def member_flops_of(self, member: int) -> float:
        """FLOPs of team member ``member`` per step, amortised."""
        return self.flops + (self.member_flops[member] if member < len(self.member_flops) else 0.0)

    def step_flops_of(self, member: int, periodic: bool) -> float:
        """FLOPs of team member ``member`` on a step with (``periodic``) or without the periodic work."""
        work = self.periodic_flops[member] if member < len(self.periodic_flops) else 0.0
        steady = self.member_flops_of(member) - work / self.period
        return steady + work if periodic else steady

    def weighted(self, factor: float) -> UpdateCost:
        """This cost with every FLOP counted ``factor`` times (a slower dtype's FLOPs)."""
        return replace(
            self,
            flops=self.flops * factor,
            member_flops=tuple(flops * factor for flops in self.member_flops),
            periodic_flops=tuple(flops * factor for flops in self.periodic_flops),
        )

    @property
    def busiest_flops(self) -> float:
        """FLOPs of the busiest team member (of the one rank, for a whole matrix)."""
        return self.flops + max(self.member_flops, default=0.0)


def matrix_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The shape a rule sees: a conv weight ``(out, in, *kernel)`` as ``(out, in·∏kernel)``."""
    shape = tuple(int(size) for size in shape)
    return shape if len(shape) <= 3 else (shape[0], math.prod(shape[1:]))


def as_matrix(tensor: Tensor) -> Tensor:
    """``tensor`` in its `matrix_shape` (a view where it can be)."""
    return tensor if tensor.ndim <= 3 else tensor.flatten(1)


def matrix_dims(shape: Sequence[int]) -> tuple[int, int, int]:
    """``(batch, rows, cols)`` of a matrix or stack of matrices; leading dims are the batch."""
    if len(shape) < 2:
        raise ValueError(f"a matrix rule needs a 2-D or stacked (…, m, n) shape, got {tuple(shape)}")
    batch = 1
    for size in shape[:-2]:
        batch *= int(size)
    return batch, int(shape[-2]), int(shape[-1])


#: The metadata of a rule's field that `setting` declares.
SETTING = "lightning_canzona.setting"


def setting(
    default: Any,
    *,
    key: str | None = None,
    group_default: Any = MISSING,
    read: bool = True,
    compare: bool = True,
) -> Any:
    """A rule's field whose param-group key (``key``), group default or reading (``read``) differs."""
    metadata = {SETTING: (key, group_default, read)}
    return field(default=default, compare=compare, metadata=metadata)


def check_non_negative(**settings: float | Tensor) -> None:
    """A `ValueError` naming the first of ``settings`` not a finite number (or 1-element tensor) >= 0."""
    for name, value in settings.items():
        if isinstance(value, Tensor) and value.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element, got shape {tuple(value.shape)}")
        number = value.item() if isinstance(value, Tensor) else value
        if not (isinstance(number, (int, float)) and math.isfinite(number) and number >= 0.0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def check_betas(name: str, betas: Sequence[float]) -> None:
    """A `ValueError` naming ``name`` unless ``betas`` are two numbers in [0, 1)."""
    if len(betas) != 2 or not all(0.0 <= beta < 1.0 for beta in betas):
        raise ValueError(f"{name} must be two numbers in [0, 1), got {betas!r}")


def check_positive_int(**settings: int) -> None:
    """A `ValueError` naming the first of ``settings`` that is not an integer >= 1."""
    for name, value in settings.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_unit_interval(**settings: float) -> None:
    """A `ValueError` naming the first of ``settings`` outside [0, 1)."""
    for name, value in settings.items():
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must lie in [0, 1), got {value!r}")


@functools.cache
def _settings(rule: type) -> tuple[tuple[str, str, Any], ...]:
    """``(field, group key, group default)`` of each setting of a dataclass ``rule``."""
    found = []
    for each in fields(rule):
        key, group_default, read = each.metadata.get(SETTING, (None, MISSING, True))
        if each.init and read:
            default = each.default if group_default is MISSING else group_default
            found.append((each.name, key or each.name, default))
    return tuple(found)


Rule = TypeVar("Rule", bound="MatrixRule")


class MatrixRule(ABC):
    """Per-matrix update math; stateless itself, all state lives in the dicts it is handed."""

    #: Name used in ``param_groups[i]["algorithm"]``.
    name: str
    #: Keys of the state that `init_elementwise_state` creates; every other key is matrix state.
    elementwise_state_keys: ClassVar[tuple[str, ...]] = ()
    #: `direction` keeps no matrix state and treats a stack as independent matrices: the engine
    #: may stack same-shape matrices into one call. (Every rule has each matrix of a stack planned
    #: alone; a rule with matrix state keeps each one's under `updates.member_prefix`.)
    batches_matrices: ClassVar[bool] = False

    @property
    def prepares_copies(self) -> bool:
        """`prepare` returns new tensors, not its gradients or state: memory the step holds."""
        return False

    @classmethod
    def settings(cls) -> dict[str, Any]:
        """The param-group settings the rule is built from, with their defaults."""
        return {key: default for _, key, default in _settings(cls)}

    @classmethod
    def from_group(cls: type[Rule], group: Mapping[str, Any], **values: Any) -> Rule:
        """The rule of a param group: its settings read from the group, ``values`` given."""
        read = {name: group[key] for name, key, _ in _settings(cls) if name not in values}
        return cls(**read, **values)

    def matrix_state(self, state: State) -> State:
        """The matrix-state part of a parameter's state."""
        return {key: value for key, value in state.items() if key not in self.elementwise_state_keys}

    def init_elementwise_state(self, param: Tensor) -> State:
        """State that lives beside the parameter and is sharded like it (may be empty)."""
        return {}

    def prepare(self, grads: Sequence[Tensor], states: Sequence[State]) -> list[Tensor]:
        """Elementwise part on gradient shards (one param group's): what `direction` needs of each."""
        return list(grads)

    @abstractmethod
    def init_matrix_state(self, shape: torch.Size, device: torch.device) -> State:
        """State that the owner of a matrix of ``shape`` holds in full (may be empty)."""

    @abstractmethod
    def direction(self, matrix: Tensor, state: State) -> Tensor:
        """The update direction for the full ``matrix`` (a ``(…, m, n)`` tensor)."""

    def matmul_dtype(self) -> torch.dtype:
        """The dtype of `direction`'s matrix products: the FLOPs of `cost` are in it."""
        return torch.float32

    def exchange_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype whole matrices travel in: `direction`'s input and output dtype."""
        return torch.promote_types(param_dtype, torch.float32)

    def lr_scale(self, shape: Sequence[int]) -> float:
        """Factor applied to the learning rate for a matrix of ``shape``."""
        return 1.0

    def apply(
        self,
        params: Sequence[Tensor],
        directions: Sequence[Tensor],
        *,
        lr: float,
        weight_decay: float,
        shapes: Sequence[Sequence[int]],
    ) -> None:
        """Decoupled weight decay, then the step along each direction, on shards, rounded once.

        ``shapes`` are the whole matrices' shapes, which the learning-rate scale depends on.
        """
        if weight_decay:
            scale_(params, 1.0 - lr * weight_decay)
        by_scale: dict[float, list[int]] = {}
        for index, shape in enumerate(shapes):
            by_scale.setdefault(self.lr_scale(shape), []).append(index)
        for scale, indices in by_scale.items():
            targets, steps = [], []
            for param, direction in zip((params[i] for i in indices), (directions[i] for i in indices)):
                if direction.dtype != param.dtype:
                    # Added in the wider dtype and rounded once, as torch.optim, one tensor at a
                    # time: a mixed-dtype foreach add is slower on a CPU (docs/benchmarks.md) and
                    # leaves the GPU's fused kernels.
                    param.add_(direction, alpha=-lr * scale)
                else:
                    targets.append(param)
                    steps.append(direction)
            if targets:
                foreach_add_(targets, steps, alpha=-lr * scale)

    @abstractmethod
    def cost(self, shape: Sequence[int]) -> UpdateCost:
        """Cost of one step on a matrix (or stack) of ``shape``."""

    def team_cost(self, shape: Sequence[int], size: int) -> UpdateCost | None:
        """The busiest member's cost when a team of ``size`` computes the matrix; ``None``: no team form."""
        return None

    def init_team_state(self, shape: Sequence[int], member: int, size: int, device: torch.device) -> State:
        """Member ``member``'s matrix state: its slice of each `team_sliced_keys` tensor, the rest whole."""
        return {}

    def team_sliced_keys(self, shape: Sequence[int]) -> tuple[str, ...]:
        """The matrix-state keys a team member holds a slice of (along the long dimension)."""
        return ()

    def team_direction(
        self, matrix: Tensor, shape: Sequence[int], member: int, size: int, state: State
    ) -> TeamComputation:
        """This member's slice of the direction, computed with the other members.

        ``matrix`` is the member's slice of a matrix of global ``shape`` (a stack of slices for a
        rule that `batches_matrices`), ``state`` its `init_team_state`; the generator yields each
        round's requests (`TeamRequest`), receives their combinations and returns the slice.
        Called only where `team_cost` is not ``None``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not split updates over teams")


def norms_not_finite(tensors: Sequence[Tensor], order: float) -> Tensor:
    """Which tensors' ``order``-norm is NaN or infinite, as one bool tensor, without a read."""
    device = tensors[0].device if tensors else None
    held = [tensor for tensor in tensors if tensor.numel()]
    if not held:
        return torch.zeros(len(tensors), dtype=torch.bool, device=device)
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in held) else torch.float32
    norms = list(foreach_norm(held, order, dtype=dtype))
    if len(held) < len(tensors):  # an empty tensor's norm is a zero, put in place without an index
        zero, computed = torch.zeros((), dtype=dtype, device=device), iter(norms)
        norms = [next(computed) if tensor.numel() else zero for tensor in tensors]
    return ~torch.isfinite(torch.stack(norms))


def non_finite(tensors: Sequence[Tensor]) -> Tensor:
    """Which tensors hold a NaN or Inf, as one bool tensor (an empty shard is finite).

    On a CPU the 2-norms screen the tensors first; only suspects are checked by their largest magnitude.
    """
    if not tensors or tensors[0].device.type != "cpu":
        return norms_not_finite(tensors, math.inf)
    flags = norms_not_finite(tensors, 2)
    suspects = flags.nonzero().flatten().tolist()
    if suspects:
        flags[suspects] = norms_not_finite([tensors[index] for index in suspects], math.inf)
    return flags


# Writing updates into parameters: rounded to nearest, or stochastically.

#: Dtypes that stochastic rounding writes into (bf16 keeps float32's exponent: its values are
#: float32 values with the low 16 bits zero).
STOCHASTIC_DTYPES = (torch.bfloat16,)


def scale_(tensors: Sequence[Tensor], factor: float) -> None:
    """``tensor *= factor`` for each tensor, rounded once as ``Tensor.mul_`` with a Python scalar.

    On a CPU the factor goes in as a 0-dim float64 tensor, which the foreach kernels multiply in
    the tensors' compute precision; accelerators' kernels take the scalar at that precision.
    """
    if not tensors:
        return
    if tensors[0].device.type == "cpu":
        foreach_mul_(list(tensors), torch.full((), factor, dtype=torch.float64))
    else:
        foreach_mul_(list(tensors), factor)


@dataclass(frozen=True)
class StochasticRounding:
    """Stochastic rounding of one step's writes into bf16 parameters.

    Attributes:
        step: The step's number (``param_groups[i]["rounding_step"]``), the same on every rank.
    """

    step: int

    @contextlib.contextmanager
    def writes(self, targets: Sequence[Tensor], keys: Sequence[str]) -> Iterator[list[Tensor]]:
        """Yield float32 copies of bf16 ``targets`` to update, rounded into them on exit.

        ``keys`` name each target's elements alike on every rank that holds them.
        """
        work = [t.float() if t.dtype in STOCHASTIC_DTYPES else t for t in targets]
        yield work
        for target, value, key in zip(targets, work, keys):
            if value is not target:
                round_stochastically_(target, value, self.seed(key))

    def seed(self, key: str) -> int:
        """A 63-bit seed for ``key`` at this step, the same in every process."""
        digest = hashlib.blake2b(f"{self.step}:{key}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1


def round_stochastically_(target: Tensor, value: Tensor, seed: int) -> None:
    """Write float32 ``value`` into bf16 ``target``, rounded up or down at random, unbiased."""
    generator = torch.Generator(device=value.device).manual_seed(seed)
    noise = torch.randint(
        0, 1 << 16, value.shape, generator=generator, device=value.device, dtype=torch.int32
    )
    bits = value.contiguous().view(torch.int32)
    bits.add_(noise).bitwise_and_(-(1 << 16))
    target.copy_(bits.view(torch.float32))


# IEEE float32 products, whatever torch's TF32 switch says.

#: The backends whose float32 matmuls TF32 (or, on a CPU, bf16) can take over.
_BACKENDS = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)

Method = TypeVar("Method", bound=Callable[..., Any])


@contextlib.contextmanager
def ieee_float32() -> Iterator[None]:
    """Float32 matmuls in IEEE float32 inside (both of torch's APIs), the switch restored after."""
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
    """A `MatrixRule` method run in `ieee_float32` where the rule's matmul dtype is float32.

    A team computation runs in it each time it is resumed, not between rounds.
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
