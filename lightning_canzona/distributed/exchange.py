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

from lightning_canzona.distributed.layout import Block, LocalShard, MatrixLayout
from lightning_canzona.distributed.memory import BufferMeter


class MicroGroupExchange:
    """The gather and scatter of one micro-group, seen from one rank.

    Args:
        members: Engine indices of the group's matrices.
        layouts: Layout of every engine matrix (indexed like ``members``' values).
        owners: Owner group-rank of every engine matrix; ``None`` under ``sync``.
        rank: This rank's group rank.
        world: Group size.
    """

    def __init__(
        self,
        members: Sequence[int],
        layouts: Sequence[MatrixLayout],
        owners: Sequence[int] | None,
        rank: int,
        world: int,
    ) -> None:
        self.members = tuple(members)
        self.rank, self.world = rank, world
        self.shapes = {m: layouts[m].shape for m in members}
        self.my_shards = {m: layouts[m].shards[rank] for m in members}
        self.computed = tuple(m for m in members if owners is None or owners[m] == rank)
        #: Owners return pieces of their updates; under ``sync`` every rank has them already.
        self.scatters = owners is not None

        def receivers(m: int) -> range | tuple[int]:
            return range(world) if owners is None else (owners[m],)

        def sends(m: int, source: int, block: Block) -> bool:
            """Whether ``source`` sends ``block`` of ``m``: an owner that holds the block uses its
            own copy (a replicated or whole-on-one-rank matrix moves nothing to it); other
            blocks come from their lowest holder."""
            if owners is not None and layouts[m].holds(owners[m], block):
                return source == owners[m]
            return layouts[m].first_holders[block] == source

        # What goes where, in buffer order: by peer rank, then by member, then by piece. Gathers
        # send local blocks and receive global ones; scatters the other way round.
        self.gather_send: list[list[tuple[int, Block]]] = [[] for _ in range(world)]
        self.gather_recv: list[list[tuple[int, Block]]] = [[] for _ in range(world)]
        for m in members:
            layout = layouts[m]
            for piece in layout.shards[rank].pieces:
                if sends(m, rank, piece.block):
                    for destination in receivers(m):
                        self.gather_send[destination].append((m, piece.local))
            if m in self.computed:
                for source, shard in enumerate(layout.shards):
                    self.gather_recv[source].extend(
                        (m, piece.block) for piece in shard.pieces if sends(m, source, piece.block)
                    )
        self.scatter_send: list[list[tuple[int, Block]]] = [[] for _ in range(world)]
        self.scatter_recv: list[list[tuple[int, Block]]] = [[] for _ in range(world)]
        if owners is not None:
            for m in members:
                if owners[m] == rank:
                    for peer, shard in enumerate(layouts[m].shards):
                        self.scatter_send[peer].extend((m, piece.block) for piece in shard.pieces)
                self.scatter_recv[owners[m]].extend((m, piece.local) for piece in self.my_shards[m].pieces)

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
    ) -> tuple[Tensor, dist.Work | None]:
        """Start the gather of the ``prepared`` local shards; returns the receive buffer and handle."""
        pieces = [
            prepared[m][local.slices].reshape(-1).to(dtype) for ps in self.gather_send for m, local in ps
        ]
        send = meter.track(torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device))
        receive = meter.track(torch.empty(sum(self.gather_recv_sizes), dtype=dtype, device=device))
        work = dist.all_to_all_single(
            receive, send, self.gather_recv_sizes, self.gather_send_sizes, group=group, async_op=True
        )
        return receive, work

    def assemble(self, received: Tensor, meter: BufferMeter) -> dict[int, Tensor]:
        """Full matrices of the members this rank computes, from the gather's buffer."""
        full = {
            m: meter.track(torch.empty(self.shapes[m], dtype=received.dtype, device=received.device))
            for m in self.computed
        }
        for m, block, chunk in _chunks(received, self.gather_recv):
            full[m][block.slices] = chunk.view(block.shape)
        return full

    def launch_scatter(
        self,
        directions: dict[int, Tensor],
        dtype: torch.dtype,
        device: torch.device,
        group: dist.ProcessGroup,
        meter: BufferMeter,
    ) -> tuple[Tensor, dist.Work | None]:
        """Start returning every rank's pieces of the computed ``directions``."""
        pieces = [
            directions[m][block.slices].reshape(-1).to(dtype) for ps in self.scatter_send for m, block in ps
        ]
        send = meter.track(torch.cat(pieces) if pieces else torch.empty(0, dtype=dtype, device=device))
        receive = meter.track(torch.empty(sum(self.scatter_recv_sizes), dtype=dtype, device=device))
        work = dist.all_to_all_single(
            receive, send, self.scatter_recv_sizes, self.scatter_send_sizes, group=group, async_op=True
        )
        return receive, work

    def my_updates(self, received: Tensor | None, directions: dict[int, Tensor]) -> dict[int, Tensor]:
        """This rank's shard of each member's direction: from the scatter, or (``sync``) cut out
        of the locally computed full directions."""
        if received is None:
            return {
                m: _local(shard, ((p.local, directions[m][p.block.slices]) for p in shard.pieces))
                for m, shard in self.my_shards.items()
                if shard.numel
            }
        pieces: dict[int, list[tuple[Block, Tensor]]] = {}
        for m, local, chunk in _chunks(received, self.scatter_recv):
            pieces.setdefault(m, []).append((local, chunk.view(local.shape)))
        return {m: _local(self.my_shards[m], values) for m, values in pieces.items()}


def _chunks(buffer: Tensor, lists: list[list[tuple[int, Block]]]) -> Iterator[tuple[int, Block, Tensor]]:
    """``(member, block, chunk)``: each entry of ``lists``, in buffer order, with its chunk."""
    entries = [entry for entries in lists for entry in entries]
    chunks = buffer.split([block.numel for _, block in entries])
    return ((m, block, chunk) for (m, block), chunk in zip(entries, chunks))


def _local(shard: LocalShard, pieces: Iterable[tuple[Block, Tensor]]) -> Tensor:
    """A local shard from its pieces: the one piece itself, or the pieces copied into place."""
    pieces = list(pieces)
    if shard.is_one_block:
        ((_, value),) = pieces
        return value
    local = torch.empty(shard.shape, dtype=pieces[0][1].dtype, device=pieces[0][1].device)
    for block, value in pieces:
        local[block.slices] = value
    return local
