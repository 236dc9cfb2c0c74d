"""Where each rank's shard of a DTensor lies in the global tensor.

Every rank asks DTensor for its own shard (``compute_local_shape_and_global_offset``); one
``all_gather_object`` when a plan is built shares those facts, so every rank knows every rank's
block without deriving any layout by hand. The blocks must tile the global tensor (replicas
allowed); a layout whose shards are not rectangular blocks (some orders of ``_StridedShard``)
cannot be rebuilt and is rejected, on every rank, naming the parameter and its placements.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


@dataclass(frozen=True)
class Block:
    """A rank's local shard: ``shape`` elements starting at ``offset`` of the global tensor."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(start, start + size) for start, size in zip(self.offset, self.shape))


@dataclass(frozen=True)
class MatrixLayout:
    """The blocks of one parameter on every rank of its group (indexed by group rank).

    Attributes:
        shape: Global shape.
        blocks: Each rank's block.
        senders: For each rank, whether it is the one that sends its block when the whole matrix
            is gathered: the lowest rank among those holding an identical, non-empty block.
    """

    shape: tuple[int, ...]
    blocks: tuple[Block, ...]
    senders: tuple[bool, ...]


def local_block(param: DTensor) -> Block:
    """This rank's block of ``param``, from DTensor's own layout computation."""
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return Block(tuple(int(o) for o in offset), tuple(int(s) for s in shape))


def _tiles(shape: tuple[int, ...], blocks: Sequence[Block]) -> bool:
    """Whether the distinct non-empty ``blocks`` cover ``shape`` exactly once."""
    distinct = {block for block in blocks if block.numel}
    if sum(block.numel for block in distinct) != math.prod(shape):
        return False
    if any(o < 0 or o + s > n for b in distinct for o, s, n in zip(b.offset, b.shape, shape)):
        return False
    # Overlaps show on the grid spanned by all block edges: count coverage per grid cell.
    edges = [
        sorted({0, n, *(o for b in distinct for o in (b.offset[d], b.offset[d] + b.shape[d]))})
        for d, n in enumerate(shape)
    ]
    coverage = torch.zeros([len(e) - 1 for e in edges], dtype=torch.int32)
    for block in distinct:
        index = tuple(
            slice(edges[d].index(block.offset[d]), edges[d].index(block.offset[d] + block.shape[d]))
            for d in range(len(shape))
        )
        coverage[index] += 1
    return bool((coverage == 1).all())


def exchange_layouts(
    names: Sequence[str], params: Sequence[DTensor], group: dist.ProcessGroup
) -> list[MatrixLayout]:
    """Every rank's block of every parameter, after one ``all_gather_object`` over ``group``.

    Raises:
        RuntimeError: On every rank, when ranks disagree on the parameters or a layout does not
            tile its global tensor.
    """
    mine = [(tuple(p.shape), local_block(p)) for p in params]
    everyone: list[list[tuple[tuple[int, ...], Block]]] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine, group=group)
    layouts = []
    for index, (name, param) in enumerate(zip(names, params)):
        if any(len(theirs) != len(mine) or theirs[index][0] != mine[index][0] for theirs in everyone):
            raise RuntimeError(
                f"Ranks disagree on the parameters of the optimizer (first at {name!r}, shape "
                f"{tuple(param.shape)}): every rank must build it from the same model."
            )
        shape = mine[index][0]
        blocks = tuple(theirs[index][1] for theirs in everyone)
        if not _tiles(shape, blocks):
            raise RuntimeError(
                f"Cannot rebuild parameter {name!r} of shape {shape} from its shards: placements "
                f"{tuple(param.placements)} on mesh {tuple(param.device_mesh.shape)} do not give each "
                "rank one rectangular block of the matrix. Shard each dimension at most once per "
                "mesh dimension, TP before FSDP (as parallelize_module then fully_shard does)."
            )
        layouts.append(MatrixLayout(shape, blocks, _senders(blocks)))
    return layouts


def _senders(blocks: Sequence[Block]) -> tuple[bool, ...]:
    first_holder: dict[Block, int] = {}
    for rank, block in enumerate(blocks):
        first_holder.setdefault(block, rank)
    return tuple(block.numel > 0 and first_holder[block] == rank for rank, block in enumerate(blocks))


def stack_member(layout: MatrixLayout, index: int) -> MatrixLayout:
    """The layout of matrix ``index`` of a stack ``[n, rows, cols]`` (split on dim 0 or not):
    each rank's block of that matrix, empty where the rank holds none of it."""

    def holds(block: Block) -> bool:
        return block.numel > 0 and block.offset[0] <= index < block.offset[0] + block.shape[0]

    empty = Block((0, 0), (0, 0))
    blocks = tuple(Block(b.offset[1:], b.shape[1:]) if holds(b) else empty for b in layout.blocks)
    return MatrixLayout(layout.shape[1:], blocks, _senders(blocks))


def holders(layout: MatrixLayout) -> tuple[int, ...]:
    """The ranks whose block is the whole matrix: an owner among them moves no bytes."""
    return tuple(rank for rank, block in enumerate(layout.blocks) if block.shape == layout.shape)


def local_tensor(tensor: Tensor) -> Tensor:
    """The local shard of a DTensor (aliasing its storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
