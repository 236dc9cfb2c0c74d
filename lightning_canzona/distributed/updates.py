"""The per-parameter parts of a step, on this rank's part of a parameter.

The same routines serve a DTensor parameter (its local shard, state sharded like it) and a plain
tensor (the whole of it), so the two paths cannot drift apart. Gradients are read after
`lightning_canzona.distributed.gradients.agree_on_gradients`: in the parameter's layout, or
``None`` for zeros.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_canzona.distributed.layout import local_tensor
from lightning_canzona.rules.adamw import adamw_step, init_adamw_state
from lightning_canzona.rules.base import (
    FAILURES,
    MatrixRule,
    as_matrix,
    matrix_shape,
    state_part,
    store_state_part,
)
from lightning_canzona.rules.rounding import StochasticRounding

State = dict[str, Tensor]


def local_grad(param: Tensor) -> Tensor:
    """This rank's part of ``param``'s gradient; zeros when it has none."""
    return local_tensor(param.grad) if param.grad is not None else torch.zeros_like(local_tensor(param))


def _local_state(state: State) -> State:
    return {key: local_tensor(value) for key, value in state.items()}


def shard_key(param: Tensor, name: str) -> str:
    """A name for this rank's part of ``param`` (named ``name``): the same on every rank that holds
    the same elements (its replicas, over the mesh dimensions that replicate it), different
    on ranks that hold others."""
    if not isinstance(param, DTensor):
        return name
    coordinate = param.device_mesh.get_coordinate() or []
    shards = [str(c) for c, placement in zip(coordinate, param.placements) if not placement.is_replicate()]
    return f"{name}@{','.join(shards)}"


@contextmanager
def _written(group: dict[str, Any], targets: list[Tensor], keys: list[str]) -> Iterator[list[Tensor]]:
    """What a step updates in place for ``targets``: themselves, or under ``stochastic_rounding``
    float32 copies of the bf16 ones, rounded into them at the end (`rules.rounding`)."""
    if not group.get("stochastic_rounding"):
        yield targets
        return
    with StochasticRounding(group["rounding_step"]).writes(targets, keys) as work:
        yield work


def step_adamw(
    params: Sequence[Tensor], names: Sequence[str], state: dict[Tensor, State], group: dict[str, Any]
) -> None:
    """One AdamW step of this rank's parts of ``params`` (named ``names``), all of ``group``."""
    param_states, states = [], []
    for param in params:
        param_state = state.setdefault(param, {})
        if not param_state:
            param_state.update(init_adamw_state(param))
        param_states.append(param_state)
        states.append(_local_state(param_state))
    targets = [local_tensor(param) for param in params]
    with _written(group, targets, [shard_key(p, n) for p, n in zip(params, names)]) as written:
        adamw_step(
            written,
            [local_grad(param) for param in params],
            states,
            lr=float(group["lr"]),
            betas=group["betas"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
        )
    for param_state, counted in zip(param_states, states):
        param_state["step"] = counted["step"]  # a number: the local view holds its own


def prepare_matrices(
    params: Sequence[Tensor], rule: MatrixRule, state: dict[Tensor, State], holds_matrix: Sequence[bool]
) -> list[Tensor]:
    """``rule``'s elementwise part on this rank's parts of ``params`` (all of one param group, in
    one call of the rule); creates the state they need.

    Args:
        params: The parameters (DTensors or plain tensors).
        rule: Their matrix rule.
        state: The optimizer's state.
        holds_matrix: Per parameter, whether this rank computes the full matrix's update, and
            so holds the matrix state (a stack's matrices create theirs when updated:
            `member_direction`).
    """
    states = []
    for param, holds in zip(params, holds_matrix):
        param_state = state.setdefault(param, {})
        if not param_state:
            param_state.update(rule.init_elementwise_state(param))
        if holds and param.ndim != 3 and not rule.matrix_state(param_state):
            param_state.update(rule.init_matrix_state(matrix_shape(param.shape), local_tensor(param).device))
        states.append(_local_state(param_state))
    return rule.prepare([local_grad(param) for param in params], states)


def member_prefix(member: int) -> str:
    """The prefix of the state keys of matrix ``member`` of a stack (no ``.``: torch's flattened
    optimizer state dicts split keys on dots)."""
    return f"stack{member}_"


def member_direction(rule: MatrixRule, matrix: Tensor, param_state: State, member: int) -> Tensor:
    """``rule``'s direction for matrix ``member`` of a stack, with that matrix's own matrix state
    (kept in the stack's state under `member_prefix`, created on first use)."""
    prefix = member_prefix(member)
    part = state_part(param_state, prefix)
    if all(key == FAILURES for key in part):
        part.update(rule.init_matrix_state(matrix.shape, matrix.device))
    direction = rule.direction(matrix, part)
    store_state_part(param_state, prefix, part)
    return direction


def full_direction(rule: MatrixRule, matrix: Tensor, param_state: State) -> Tensor:
    """``rule``'s direction for a whole parameter: a matrix (a convolution's weight as its
    `matrix_shape`), or a stack matrix by matrix (each with its own state, as the engine plans
    them) unless the rule keeps no matrix state."""
    if matrix.ndim != 3 or rule.batches_matrices:
        return rule.direction(as_matrix(matrix), param_state).reshape(matrix.shape)
    return torch.stack([member_direction(rule, m, param_state, e) for e, m in enumerate(matrix)])


def apply_matrices(
    params: Sequence[Tensor],
    names: Sequence[str],
    rule: MatrixRule,
    updates: Sequence[Tensor],
    group: dict[str, Any],
    members: Sequence[int | None] | None = None,
) -> None:
    """Write ``updates`` (this rank's blocks of the full directions) into this rank's parts of
    ``params`` (named ``names``; all of ``group``, in one call of the rule), or each into matrix
    ``members[i]`` of its local part of a stack."""
    members = members or [None] * len(params)
    targets = [
        local_tensor(param) if member is None else local_tensor(param)[member]
        for param, member in zip(params, members)
    ]
    keys = [
        shard_key(param, name) + ("" if member is None else f"[{member}]")
        for param, name, member in zip(params, names, members)
    ]
    shapes = [matrix_shape(param.shape) for param in params]
    with _written(group, targets, keys) as written:
        rule.apply(written, updates, lr=float(group["lr"]), weight_decay=group["weight_decay"], shapes=shapes)
