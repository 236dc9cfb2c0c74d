"""How a matrix is cut into slices: what the update rules, the planner and the engine share.

A team of ranks computes one matrix's update on slices of it along its long side (`long_dim`,
`member_blocks`), each a near-equal share (`split_sizes`). The lowest module of the package: it
imports nothing of it, so that rules, planning and the engine all depend on it, never on each
other for it.
"""

from __future__ import annotations

from collections.abc import Sequence


def split_sizes(length: int, parts: int) -> tuple[int, ...]:
    """``length`` cut into ``parts`` near-equal sizes, the larger ones first: ``(7, 3)`` → ``(3, 2, 2)``."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    base, extra = divmod(length, parts)
    return tuple(base + (1 if index < extra else 0) for index in range(parts))


def long_dim(shape: Sequence[int]) -> int:
    """The dimension of a matrix that a team slices: the columns of a wide or square matrix, the
    rows of a tall one (Newton–Schulz iterates on the wide orientation; slices of its long side
    keep the Gram matrix whole on every member)."""
    rows, cols = shape[-2], shape[-1]
    return len(shape) - 2 if rows > cols else len(shape) - 1


def member_blocks(shape: Sequence[int], size: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(offset, shape)`` of each member's slice of a matrix of ``shape`` in a team of ``size``."""
    dim = long_dim(shape)
    blocks, start = [], 0
    for length in split_sizes(shape[dim], size):
        offset = [0] * len(shape)
        offset[dim] = start
        block_shape = list(shape)
        block_shape[dim] = length
        blocks.append((tuple(offset), tuple(block_shape)))
        start += length
    return blocks
