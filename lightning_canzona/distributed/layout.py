"""Where each rank's shard of a DTensor lies in the global tensor: a list of rectangular *pieces*,
each a block of the global tensor, read off DTensor itself (`local_shard`) and shared once per plan
(`exchange_layouts`). docs/architecture.md#layouts tells how.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from lightning_canzona.compat import StridedShard, root_mesh

#: ``(start, length)``: consecutive global indices along one dimension.
Run = tuple[int, int]


@dataclass(frozen=True)
class Block:
    """A rectangular block: ``shape`` elements starting at ``offset``."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(start, start + size) for start, size in zip(self.offset, self.shape))

    def intersection(self, other: Block) -> Block | None:
        """The block that this and ``other`` have in common, or ``None``."""
        starts = [max(x, y) for x, y in zip(self.offset, other.offset)]
        ends = [min(x + m, y + n) for x, m, y, n in zip(self.offset, self.shape, other.offset, other.shape)]
        if any(end <= start for start, end in zip(starts, ends)):
            return None
        return Block(tuple(starts), tuple(end - start for start, end in zip(starts, ends)))


@dataclass(frozen=True)
class Piece:
    """A block of the global tensor (``block``) and where a rank's local tensor holds it (``local``)."""

    block: Block
    local: Block


@dataclass(frozen=True)
class LocalShard:
    """A rank's local tensor: per dimension, the runs of global indices it holds, in local order."""

    runs: tuple[tuple[Run, ...], ...]

    @cached_property
    def shape(self) -> tuple[int, ...]:
        return tuple(sum(length for _, length in runs) for runs in self.runs)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def pieces(self) -> tuple[Piece, ...]:
        """The local tensor's rectangular pieces, in row-major order of their local offsets."""
        per_dim = []
        for runs in self.runs:
            starts = itertools.accumulate((length for _, length in runs), initial=0)
            per_dim.append([(start, local, length) for (start, length), local in zip(runs, starts)])
        pieces = []
        for corner in itertools.product(*per_dim):
            shape = tuple(length for _, _, length in corner)
            block = Block(tuple(start for start, _, _ in corner), shape)
            pieces.append(Piece(block, Block(tuple(local for _, local, _ in corner), shape)))
        return tuple(pieces)

    @property
    def is_one_block(self) -> bool:
        """Whether the local tensor is a single block of the global one (no copy to assemble it)."""
        return all(len(runs) <= 1 for runs in self.runs)


#: What a rank that holds nothing of a matrix holds.
NOTHING = LocalShard(((), ()))


@dataclass(frozen=True)
class MatrixLayout:
    """The shards of one parameter of global ``shape`` on every rank of its group (``shards[rank]``)."""

    shape: tuple[int, ...]
    shards: tuple[LocalShard, ...]

    @cached_property
    def first_holders(self) -> dict[Block, int]:
        """The lowest rank holding each distinct global block: the one that sends it in a gather."""
        first: dict[Block, int] = {}
        for rank, shard in enumerate(self.shards):
            for piece in shard.pieces:
                first.setdefault(piece.block, rank)
        return first

    def holds(self, rank: int, block: Block) -> bool:
        return any(piece.block == block for piece in self.shards[rank].pieces)

    def held_numel(self, rank: int, block: Block) -> int:
        """How many elements of ``block`` ``rank``'s shard holds."""
        parts = (piece.block.intersection(block) for piece in self.shards[rank].pieces)
        return sum(part.numel for part in parts if part is not None)


def _runs(indices: Sequence[int]) -> tuple[Run, ...]:
    """``[4, 5, 6, 0, 1]`` → ``((4, 3), (0, 2))``."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and runs[-1][0] + runs[-1][1] == index:
            runs[-1][1] += 1
        else:
            runs.append([index, 1])
    return tuple((start, length) for start, length in runs)


def planning_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh on which the parameters of ``mesh`` are planned: the mesh it was sliced from, so that
    a parameter replicated over TP has its update computed once (docs/architecture.md#one-step-on-a-mesh)."""
    root = root_mesh(mesh)
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if root is mesh or not names or not root_names or not set(names) <= set(root_names):
        return mesh
    return root


def placements_on(param: DTensor, mesh: DeviceMesh) -> list[Placement]:
    """``param``'s placements on ``mesh`` (its own, or its root): replicated along the dimensions it lacks."""
    own = param.device_mesh
    if own == mesh:
        return list(param.placements)
    names = list(own.mesh_dim_names or ())
    return [
        param.placements[names.index(n)] if n in names else Replicate() for n in mesh.mesh_dim_names or ()
    ]


def local_shard(param: DTensor, mesh: DeviceMesh | None = None, gathered: Collection[str] = ()) -> LocalShard:
    """This rank's shard of ``param`` seen on ``mesh`` (by default its own), with the dimensions named
    in ``gathered`` taken as replicated (FSDP2's ``"data_parallel"``): each dimension's index vector
    distributed by DTensor itself, without communication."""
    mesh = mesh or param.device_mesh
    names = mesh.mesh_dim_names or ()
    placements = [
        Replicate() if names and names[i] in gathered else p for i, p in enumerate(placements_on(param, mesh))
    ]
    runs = []
    for dim, size in enumerate(param.shape):
        along = [
            p if isinstance(p, (Shard, StridedShard)) and p.dim % param.ndim == dim else Replicate()
            for p in placements
        ]
        shape = [size if d == dim else 1 for d in range(param.ndim)]
        indices = torch.arange(size, device=mesh.device_type).view(shape)
        mine = distribute_tensor(indices, mesh, along, src_data_rank=None).to_local()
        runs.append(_runs(mine.reshape(-1).tolist()))
    return LocalShard(tuple(runs))


def _tiles(shape: tuple[int, ...], blocks: set[Block]) -> bool:
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
    names: Sequence[str], params: Sequence[DTensor], mesh: DeviceMesh, group: dist.ProcessGroup
) -> list[MatrixLayout]:
    """Every rank's shard of every parameter, seen on ``mesh``, after one ``all_gather_object``. Raises
    ``RuntimeError`` on every rank when ranks disagree on the parameters, or a layout does not tile its
    tensor or does not match a rank's local tensor."""
    mine = []
    for param in params:
        shard = local_shard(param, mesh)
        mine.append((tuple(param.shape), shard, shard.shape == tuple(param.to_local().shape)))
    everyone: list[list[tuple[tuple[int, ...], LocalShard, bool]]] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine, group=group)
    layouts = []
    for index, (name, param) in enumerate(zip(names, params)):
        if any(len(theirs) != len(mine) or theirs[index][0] != mine[index][0] for theirs in everyone):
            raise RuntimeError(
                f"Ranks disagree on the parameters of the optimizer (first at {name!r}, shape "
                f"{tuple(param.shape)}): every rank must build it from the same model."
            )
        shape = mine[index][0]
        shards = tuple(theirs[index][1] for theirs in everyone)
        consistent = all(theirs[index][2] for theirs in everyone)
        if not consistent or not _tiles(shape, {p.block for s in shards for p in s.pieces}):
            raise RuntimeError(
                f"Cannot rebuild parameter {name!r} of shape {shape} from its shards: the local "
                f"tensors do not match placements {tuple(param.placements)} on mesh "
                f"{tuple(param.device_mesh.shape)}. Build it with distribute_tensor, "
                "parallelize_module or fully_shard, or pass DTensor.from_local the local tensors "
                "that its placements describe."
            )
        layouts.append(MatrixLayout(shape, shards))
    return layouts


def stack_member(layout: MatrixLayout, index: int) -> tuple[MatrixLayout, tuple[int | None, ...]]:
    """The layout of matrix ``index`` of a stack ``[n, rows, cols]``, and where each rank's local
    tensor holds it on dim 0 (``None``: the rank holds none of it)."""
    shards, positions = [], []
    for shard in layout.shards:
        position = None
        local = 0
        for start, length in shard.runs[0]:
            if start <= index < start + length:
                position = local + index - start
            local += length
        held = position is not None and shard.numel > 0
        positions.append(position if held else None)
        shards.append(LocalShard(shard.runs[1:]) if held else NOTHING)
    return MatrixLayout(layout.shape[1:], tuple(shards)), tuple(positions)


def holders(layout: MatrixLayout) -> tuple[int, ...]:
    """The ranks that hold the whole matrix: an owner among them moves no bytes."""
    return tuple(rank for rank, shard in enumerate(layout.shards) if shard.shape == layout.shape)


def local_tensor(tensor: Tensor) -> Tensor:
    """The local shard of a DTensor (aliasing its storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
