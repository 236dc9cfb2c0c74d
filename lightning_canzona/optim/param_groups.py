"""Split a module's parameters into matrix groups and an AdamW group (`matrix_param_groups`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase
from typing import Any

from torch import nn

from lightning_canzona.rules.blocks import RowBlocks, as_row_blocks

#: Last name components that mark a linear layer as an output head.
HEAD_NAMES = ("lm_head", "head", "output", "classifier", "score")
#: Last name components that mark a linear layer as a mixture-of-experts router (per-expert rows).
ROUTER_NAMES = ("router", "gate")
#: The parameter name of transformers' fused mixture-of-experts gate/up stacks.
GATE_UP_NAME = "gate_up_proj"


def matrix_param_groups(
    module: nn.Module,
    *,
    matrix: Sequence[str] = (),
    elementwise: Sequence[str] = (),
    row_blocks: Mapping[str, int | Sequence[int]] | None = None,
) -> list[dict[str, Any]]:
    """Param groups for `lightning_canzona.Muon`, ``NorMuon``, ``Shampoo`` or ``SOAP`` (docs/models.md).

    Args:
        module: The model: linear weights (not heads, routers, tied ones) and expert stacks are matrices.
        matrix: ``fnmatch`` patterns of parameters to update with the matrix rule.
        elementwise: Patterns of parameters to update with AdamW (they win over ``matrix``).
        row_blocks: Patterns of matrices to update block by block, with their blocks; ``1``: whole.

    Returns:
        The matrix group, one group per distinct ``row_blocks``, then the AdamW group, none empty.

    Raises:
        ValueError: A ``row_blocks`` pattern matches nothing or a non-matrix, or patterns disagree.
    """
    embedding_weights = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
    default_matrices: set[int] = set()
    for name, child in module.named_modules():
        if _is_linear(child) and name.rpartition(".")[2] not in HEAD_NAMES + ROUTER_NAMES:
            if id(child.weight) not in embedding_weights:
                default_matrices.add(id(child.weight))
        if _holds_experts(name, child):
            default_matrices.update(id(p) for p in child.parameters(recurse=False) if p.ndim == 3)

    matrices: list[tuple[str, nn.Parameter]] = []
    others: list[tuple[str, nn.Parameter]] = []
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        if any(fnmatchcase(name, pattern) for pattern in elementwise):
            is_matrix = False
        elif any(fnmatchcase(name, pattern) for pattern in matrix):
            is_matrix = True
        else:
            is_matrix = id(param) in default_matrices
        (matrices if is_matrix else others).append((name, param))
    blocks = _row_blocks(module, matrices, others, row_blocks or {})
    groups: list[dict[str, Any]] = [{"params": [entry for entry in matrices if entry[0] not in blocks]}]
    for spec in dict.fromkeys(blocks[name] for name, _ in matrices if name in blocks):
        groups.append(
            {"params": [entry for entry in matrices if blocks.get(entry[0]) == spec], "row_blocks": spec}
        )
    groups.append({"params": others, "algorithm": "adamw"})
    return [group for group in groups if group["params"]]


def _row_blocks(
    module: nn.Module,
    matrices: list[tuple[str, nn.Parameter]],
    others: list[tuple[str, nn.Parameter]],
    patterns: Mapping[str, int | Sequence[int]],
) -> dict[str, RowBlocks]:
    """The declared row blocks of each matrix that is split: the patterns', else the default."""
    declared: dict[str, RowBlocks] = {}
    matrix_names = {name for name, _ in matrices}
    for pattern, spec in patterns.items():
        blocks = as_row_blocks(spec)
        named = [(name, param) for name, param in matrices + others if fnmatchcase(name, pattern)]
        if not named:
            raise ValueError(f"row_blocks pattern {pattern!r} matches no trainable parameter")
        for name, param in named:
            if name not in matrix_names:
                raise ValueError(
                    f"row_blocks pattern {pattern!r} matches {name!r} of shape {tuple(param.shape)}, "
                    "which is not in the matrix group (AdamW updates it); only matrices split"
                )
            if declared.setdefault(name, blocks) != blocks:
                raise ValueError(f"row_blocks patterns give {name!r} both {declared[name]!r} and {blocks!r}")
    split = {name: 2 for name in _fused_gate_up(module, matrices)}
    split.update(declared)
    return {name: blocks for name, blocks in split.items() if blocks != 1}


def _fused_gate_up(module: nn.Module, matrices: list[tuple[str, nn.Parameter]]) -> list[str]:
    """The fused expert gate/up stacks among ``matrices`` whose rows are gate, then up."""
    matrix_names = {name for name, _ in matrices}
    fused = []
    for prefix, child in module.named_modules():
        gate_up, down = getattr(child, GATE_UP_NAME, None), getattr(child, "down_proj", None)
        name = f"{prefix}.{GATE_UP_NAME}" if prefix else GATE_UP_NAME
        if not (
            isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter) and name in matrix_names
        ):
            continue
        if gate_up.ndim == down.ndim == 3 and gate_up.shape[1:] == (2 * down.shape[2], down.shape[1]):
            fused.append(name)
    return fused


def _is_linear(module: nn.Module) -> bool:
    cls = type(module)
    return isinstance(module, nn.Linear) or (
        cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.")
    )


def _holds_experts(name: str, module: nn.Module) -> bool:
    return name.rpartition(".")[2] == "experts" or type(module).__name__.endswith("Experts")
