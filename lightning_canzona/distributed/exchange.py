"""Packed all-to-all buffers for one micro-group: gather to owners, scatter back to shards.

For a micro-group, every rank sends its pieces (rectangular blocks, see
`lightning_canzona.distributed.layout`) of the matrices in the group to each matrix's owner in
**one** ``all_to_all_single``; owners assemble full matrices, compute, and return every rank's
pieces of the update in **one** more. Split sizes depend only on the plan and the
layouts, so they are computed once. Under the ``sync`` policy every rank receives every block and
computes every matrix; it then needs no scatter.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_canzona.distributed.agreement import InFlight
from lightning_canzona.distributed.layout import Block, LocalShard, MatrixLayout, Piece
from lightning_canzona.distributed.memory import BufferMeter
from lightning_canzona.geometry import member_blocks


class MicroGroupExchange:
    """The gather and scatter of one micro-group, seen from one rank.

    Each member matrix goes to the ranks that compute it: its owner (the whole matrix), its
    team (each member a slice, `lightning_canzona.geometry.member_blocks`), or, under
    ``sync``, every rank (the whole matrix).

    Args:
        members: Engine indices of the group's matrices.
        layouts: Layout of every engine matrix (indexed like ``members``' values).
        teams: The group ranks that compute every engine matrix; ``None`` under ``sync``.
        rank: This rank's group rank.
        world: Group size.
    """

    def __init__(
        self,
        members: Sequence[int],
        layouts: Sequence[MatrixLayout],
        teams: Sequence[tuple[int, ...]] | None,
        rank: int,
        world: int,
    ) -> None:
        self.members = tuple(members)
        self.rank, self.world = rank, world
        self.my_shards = {m: layouts[m].shards[rank] for m in members}
        #: Per member matrix, ``(rank, block)`` of every rank that computes it and what it computes.
        targets = {m: _targets(layouts[m].shape, None if teams is None else teams[m], world) for m in members}
        #: The block of each matrix that this rank computes.
        self.regions = {m: block for m in members for r, block in targets[m] if r == rank}
        self.computed = tuple(self.regions)
        #: Owners return pieces of their updates; under ``sync`` every rank has them already.
        self.scatters = teams is not None

        def sender(m: int, destination: int, block: Block) -> int:
            """Who sends ``block`` of ``m`` to ``destination``: itself if it holds the block (a
            replicated or whole-on-one-rank matrix moves nothing to it), else its lowest holder."""
            if teams is not None and layouts[m].holds(destination, block):
                return destination
            return layouts[m].first_holders[block]

        # What goes where, in buffer order: by peer rank, then by member, then by piece. Gathers
        # send local blocks and receive blocks of the computed region; scatters the other way.
        self.gather_send: list[list[tuple[int, Block]]] = [[] for _ in range(world)]
        self.gather_recv: list[list[tuple[int, Block]]] = [[] for _ in range(world)]
        self.scatter_send: list[list[tuple[int, Block]]] = [[] for _ in range(world)]
        self.scatter_recv: list[list[tuple[int, Block]]] = [[] for _ in range(world)]
        for m in members:
            shards = layouts[m].shards
            for destination, region in targets[m]:
                for piece in shards[rank].pieces:
                    part = piece.block.intersection(region)
                    if part is not None and sender(m, destination, piece.block) == rank:
                        self.gather_send[destination].append((m, _local_block(piece, part)))
                    if part is not None and teams is not None:
                        self.scatter_recv[destination].append((m, _local_block(piece, part)))
                if destination != rank:
                    continue
                for peer, shard in enumerate(shards):
                    for piece in shard.pieces:
                        part = piece.block.intersection(region)
                        if part is None:
                            continue
                        if sender(m, rank, piece.block) == peer:
                            self.gather_recv[peer].append((m, _relative(part, region)))
                        if teams is not None:
                            self.scatter_send[peer].append((m, _relative(part, region)))

        # What this rank would send itself skips the buffers: copied from its prepared shard into
        # the region it computes (`assemble`), and from its directions into its updates
        # (`my_updates`), once each instead of into a send buffer, through the backend and out of
        # a receive buffer. Both lists hold the same pieces in the same order.
        #: ``(member, block of the local shard, block of the computed region)`` of each such piece.
        self.gather_self = [
            (m, local, region)
            for (m, local), (_, region) in zip(self.gather_send[rank], self.gather_recv[rank])
        ]
        self.scatter_self = [
            (m, local, region)
            for (m, region), (_, local) in zip(self.scatter_send[rank], self.scatter_recv[rank])
        ]
        for lists in (self.gather_send, self.gather_recv, self.scatter_send, self.scatter_recv):
            lists[rank] = []

        def sizes(lists: list[list[tuple[int, Block]]]) -> list[int]:
            return [sum(block.numel for _, block in pieces) for pieces in lists]

        self.gather_send_sizes, self.gather_recv_sizes = sizes(self.gather_send), sizes(self.gather_recv)
        self.scatter_send_sizes, self.scatter_recv_sizes = sizes(self.scatter_send), sizes(self.scatter_recv)

    def launch_gather(
        self,
        prepared: dict[int, Tensor],
        dtype: torch.dtype,
        device: torch.device,
        group: dist.ProcessGroup,
        meter: BufferMeter,
    ) -> tuple[Tensor, InFlight]:
        """Start the gather of the ``prepared`` local shards; returns the receive buffer and handle."""
        pieces = (prepared[m][local.slices] for ps in self.gather_send for m, local in ps)
        send = meter.track(_packed(pieces, sum(self.gather_send_sizes), dtype, device))
        receive = meter.track(torch.empty(sum(self.gather_recv_sizes), dtype=dtype, device=device))
        work = InFlight(
            dist.all_to_all_single, receive, send, self.gather_recv_sizes, self.gather_send_sizes, group=group
        )
        return receive, work

    def assemble(
        self, received: Tensor, prepared: dict[int, Tensor], meter: BufferMeter
    ) -> dict[int, Tensor]:
        """The blocks this rank computes (whole matrices, or a team member's slices), from the
        gather's buffer and, for what this rank holds itself, its ``prepared`` shards."""
        pieces: dict[int, list[tuple[Block, Tensor]]] = {m: [] for m in self.computed}
        for m, block, chunk in _chunks(received, self.gather_recv):
            pieces[m].append((block, chunk))
        for m, local, region in self.gather_self:
            pieces[m].append((region, prepared[m][local.slices]))
        return {
            m: _placed(
                meter.track(torch.empty(self.regions[m].shape, dtype=received.dtype, device=received.device)),
                pieces[m],
            )
            for m in self.computed
        }

    def launch_scatter(
        self,
        directions: dict[int, Tensor],
        dtype: torch.dtype,
        device: torch.device,
        group: dist.ProcessGroup,
        meter: BufferMeter,
    ) -> tuple[Tensor, InFlight]:
        """Start returning every rank's pieces of the computed ``directions`` (each of this rank's
        `regions`)."""
        pieces = (directions[m][block.slices] for ps in self.scatter_send for m, block in ps)
        send = meter.track(_packed(pieces, sum(self.scatter_send_sizes), dtype, device))
        receive = meter.track(torch.empty(sum(self.scatter_recv_sizes), dtype=dtype, device=device))
        work = InFlight(
            dist.all_to_all_single,
            receive,
            send,
            self.scatter_recv_sizes,
            self.scatter_send_sizes,
            group=group,
        )
        return receive, work

    def my_updates(
        self, received: Tensor | None, directions: dict[int, Tensor], dtype: torch.dtype
    ) -> dict[int, Tensor]:
        """This rank's shard of each member's direction: from the scatter and, for the regions
        it computed itself, its ``directions`` (in the scatter's ``dtype``, as if sent); or
        (``sync``) cut out of the locally computed full directions."""
        if received is None:
            return {
                m: _local(shard, [(p.local, directions[m][p.block.slices]) for p in shard.pieces])
                for m, shard in self.my_shards.items()
                if shard.numel
            }
        pieces: dict[int, list[tuple[Block, Tensor]]] = {}
        for m, local, chunk in _chunks(received, self.scatter_recv):
            pieces.setdefault(m, []).append((local, chunk))
        for m, local, region in self.scatter_self:
            pieces.setdefault(m, []).append((local, directions[m][region.slices].to(dtype)))
        return {m: _local(self.my_shards[m], values) for m, values in pieces.items()}


def _packed(pieces: Iterable[Tensor], numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """One flat buffer of ``numel`` elements of ``dtype`` holding ``pieces`` in order: one
    concatenation of them all (one batched copy on a GPU where they are contiguous and of
    ``dtype``; it converts the dtype too), not a copy per piece from Python. A piece that is not
    contiguous in its tensor (a team member's slice across the rows) is gathered by a copy of
    its own first."""
    flat = [piece.reshape(-1) for piece in pieces]
    assert sum(piece.numel() for piece in flat) == numel, f"{len(flat)} pieces for a buffer of {numel}"
    buffer = torch.empty(numel, dtype=dtype, device=device)
    if flat:
        torch.cat(flat, out=buffer)
    return buffer


def _chunks(buffer: Tensor, lists: list[list[tuple[int, Block]]]) -> Iterator[tuple[int, Block, Tensor]]:
    """``(member, block, chunk)``: each entry of ``lists``, in buffer order, with its chunk."""
    entries = [entry for entries in lists for entry in entries]
    chunks = buffer.split([block.numel for _, block in entries])
    return ((m, block, chunk) for (m, block), chunk in zip(entries, chunks))


def _targets(shape: tuple[int, ...], team: tuple[int, ...] | None, world: int) -> list[tuple[int, Block]]:
    """``(rank, block)`` for every rank that computes a matrix of ``shape``: each rank the whole
    matrix (``sync``: ``team is None``), or each team member its slice."""
    if team is None:
        return [(rank, Block((0,) * len(shape), shape)) for rank in range(world)]
    return [(rank, Block(*block)) for rank, block in zip(team, member_blocks(shape, len(team)))]


def _local_block(piece: Piece, part: Block) -> Block:
    """Where a rank's local tensor holds ``part`` of its ``piece``."""
    offset = tuple(at + p - g for at, p, g in zip(piece.local.offset, part.offset, piece.block.offset))
    return Block(offset, part.shape)


def _relative(part: Block, region: Block) -> Block:
    """``part`` in the coordinates of the ``region`` that contains it."""
    return Block(tuple(p - r for p, r in zip(part.offset, region.offset)), part.shape)


def _local(shard: LocalShard, pieces: list[tuple[Block, Tensor]]) -> Tensor:
    """A local shard from its pieces (flat, or of their blocks' shapes): the one piece that is
    all of it, or the pieces placed (`_placed`)."""
    if len(pieces) == 1 and pieces[0][0].shape == shard.shape:
        return pieces[0][1].view(shard.shape)
    value = pieces[0][1]
    return _placed(torch.empty(shard.shape, dtype=value.dtype, device=value.device), pieces)


def _placed(out: Tensor, pieces: list[tuple[Block, Tensor]]) -> Tensor:
    """``out`` with each ``(block, value)`` of ``pieces`` (flat, or of the block's shape) copied
    to its block, the blocks tiling ``out``. Blocks that each fill a run of ``out``'s memory (its
    rows, or its stacked matrices: a slice of the first dimension they do not span) are placed
    by one concatenation in memory order; other tilings (the columns of a row-wise
    tensor-parallel shard) by a copy each."""
    if all(_contiguous_in(block, out.shape) for block, _ in pieces):
        ordered = sorted(pieces, key=lambda piece: piece[0].offset)
        torch.cat([value.reshape(-1) for _, value in ordered], out=out.view(-1))
        return out
    for block, value in pieces:
        out[block.slices] = value.view(block.shape)
    return out


def _contiguous_in(block: Block, shape: Sequence[int]) -> bool:
    """Whether ``block`` is a contiguous run of a row-major tensor of ``shape``: size 1 in every
    dimension before some dimension, and whole in every dimension after it."""
    dims = len(shape)
    first = next((d for d in range(dims) if block.shape[d] != 1), dims - 1)
    return all(block.shape[d] == shape[d] for d in range(first + 1, dims))
