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

from lightning_canzona.distributed.inflight import InFlight
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
        full = {
            m: meter.track(torch.empty(self.regions[m].shape, dtype=received.dtype, device=received.device))
            for m in self.computed
        }
        for m, block, chunk in _chunks(received, self.gather_recv):
            full[m][block.slices] = chunk.view(block.shape)
        for m, local, region in self.gather_self:
            full[m][region.slices] = prepared[m][local.slices]
        return full

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
                m: _local(shard, ((p.local, directions[m][p.block.slices]) for p in shard.pieces))
                for m, shard in self.my_shards.items()
                if shard.numel
            }
        pieces: dict[int, list[tuple[Block, Tensor]]] = {}
        for m, local, chunk in _chunks(received, self.scatter_recv):
            pieces.setdefault(m, []).append((local, chunk.view(local.shape)))
        for m, local, region in self.scatter_self:
            pieces.setdefault(m, []).append((local, directions[m][region.slices].to(dtype)))
        return {m: _local(self.my_shards[m], values) for m, values in pieces.items()}


def _packed(pieces: Iterable[Tensor], numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """One flat buffer of ``numel`` elements of ``dtype`` holding ``pieces`` in order, each
    copied once (the copy converts the dtype and gathers a strided block alike)."""
    buffer = torch.empty(numel, dtype=dtype, device=device)
    offset = 0
    for piece in pieces:
        buffer[offset : offset + piece.numel()].view(piece.shape).copy_(piece)
        offset += piece.numel()
    assert offset == numel, f"packed {offset} elements into a buffer of {numel}"
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


def _local(shard: LocalShard, pieces: Iterable[tuple[Block, Tensor]]) -> Tensor:
    """A local shard from its pieces: the one piece that is all of it, or the pieces copied into
    place."""
    pieces = list(pieces)
    if len(pieces) == 1 and pieces[0][0].shape == shard.shape:
        return pieces[0][1]
    local = torch.empty(shard.shape, dtype=pieces[0][1].dtype, device=pieces[0][1].device)
    for block, value in pieces:
        local[block.slices] = value
    return local
