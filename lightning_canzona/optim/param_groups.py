"""Split a module's parameters into a matrix group and an AdamW group.

Matrix rules are for the hidden layers' weight matrices. Embeddings, the output head, norms, biases
and other 1-D tensors are better served by AdamW (Jordan et al., 2024; Liu et al., 2025): an
embedding's rows are independent lookups, not a linear map, and the head's rows are per-token.
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase
from typing import Any

from torch import nn

#: Last name components that mark a linear layer as an output head.
HEAD_NAMES = ("lm_head", "head", "output", "classifier", "score")
#: Last name components that mark a linear layer as a mixture-of-experts router (per-expert rows).
ROUTER_NAMES = ("router", "gate")


def matrix_param_groups(
    module: nn.Module,
    *,
    matrix: Sequence[str] = (),
    elementwise: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """Param groups for `lightning_canzona.Muon`, ``Shampoo`` or ``SOAP``.

    By default these are matrices: the weights of ``nn.Linear`` layers and of ``transformers``'
    ``Conv1D`` (GPT-2's linear layers, stored transposed), except an output head (a layer whose
    own name is one of `HEAD_NAMES`), a router (`ROUTER_NAMES`) and a weight tied to an
    ``nn.Embedding``; and the 3-D stacks
    of mixture-of-experts layers (``[experts, rows, cols]``, in a module named ``experts`` or whose
    class name ends in ``Experts``), which the matrix rule updates expert by expert. Every other
    trainable parameter goes to AdamW, routers among them. Patterns (``fnmatch`` on the parameter's qualified
    name, e.g. ``"*.experts.*"``) override the default; ``elementwise`` wins over ``matrix``.

    Args:
        module: The model.
        matrix: Patterns of parameters to update with the matrix rule (e.g. 3-D expert stacks).
        elementwise: Patterns of parameters to update with AdamW.

    Returns:
        ``[{"params": [(name, param), …]}, {"params": [(name, param), …], "algorithm": "adamw"}]``,
        leaving out an empty group. Named entries let errors name the parameter. A group may
        span device meshes (a 2-D DP×TP mesh and its 1-D DP slice, say): the engine plans a mesh
        and its slices as one (`lightning_canzona.distributed.layout.planning_mesh`).
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
    groups: list[dict[str, Any]] = [{"params": matrices}, {"params": others, "algorithm": "adamw"}]
    return [group for group in groups if group["params"]]


def _is_linear(module: nn.Module) -> bool:
    cls = type(module)
    return isinstance(module, nn.Linear) or (
        cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.")
    )


def _holds_experts(name: str, module: nn.Module) -> bool:
    return name.rpartition(".")[2] == "experts" or type(module).__name__.endswith("Experts")
