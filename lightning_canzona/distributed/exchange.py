"""Packed all-to-all buffers for one micro-group: gather to owners, scatter back to shards.

For a micro-group, every rank sends each of its blocks (of the matrices in the group) to the
matrix's owner in **one** ``all_to_all_single``; owners assemble full matrices, compute, and return
every rank's block of the update in **one** more. Split sizes depend only on the plan and the
layouts, so they are computed once. Under the ``sync`` policy every rank receives every block and
computes every matrix; it then needs no scatter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_canzona.distributed.layout import Block, MatrixLayout
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
        self.my_blocks = {m: layouts[m].blocks[rank] for m in members}
        self.computed = tuple(m for m in members if owners is None or owners[m] == rank)
        #: Owners return blocks of their updates; under ``sync`` every rank has them already.
        self.scatters = owners is not None

        def receivers(m: int) -> range | tuple[int]:
            return range(world) if owners is None else (owners[m],)

        def sends(m: int, source: int) -> bool:
            """Whether ``source`` sends its block of ``m``: an owner that holds a block uses its
            own copy (a replicated or whole-on-one-rank matrix moves nothing to it); other
            blocks come from their lowest holder."""
            blocks = layouts[m].blocks
            if owners is None or not blocks[source].numel:
                return layouts[m].senders[source]
            if blocks[owners[m]] == blocks[source]:
                return source == owners[m]
            return layouts[m].senders[source]

        # What goes where, in buffer order: by peer rank, then by member.
        self.gather_send: list[list[int]] = [[] for _ in range(world)]
        self.gather_recv: list[list[tuple[int, Block]]] = [[] for _ in range(world)]
        for m in members:
            layout = layouts[m]
            if sends(m, rank):
                for destination in receivers(m):
                    self.gather_send[destination].append(m)
            if m in self.computed:
                for source in range(world):
                    if sends(m, source):
                        self.gather_recv[source].append((m, layout.blocks[source]))
        self.scatter_send: list[list[tuple[int, Block]]] = [[] for _ in range(world)]
        self.scatter_recv: list[list[tuple[int, Block]]] = [[] for _ in range(world)]
        if owners is not None:
            for m in members:
                for peer, block in enumerate(layouts[m].blocks):
                    if block.numel and owners[m] == rank:
                        self.scatter_send[peer].append((m, block))
                if self.my_blocks[m].numel:
                    self.scatter_recv[owners[m]].append((m, self.my_blocks[m]))

        self.gather_send_sizes = [sum(self.my_blocks[m].numel for m in ms) for ms in self.gather_send]
        self.gather_recv_sizes = [sum(b.numel for _, b in pieces) for pieces in self.gather_recv]
        self.scatter_send_sizes = [sum(b.numel for _, b in pieces) for pieces in self.scatter_send]
        self.scatter_recv_sizes = [sum(b.numel for _, b in pieces) for pieces in self.scatter_recv]

    def launch_gather(
        self,
        prepared: dict[int, Tensor],
        dtype: torch.dtype,
        device: torch.device,
        group: dist.ProcessGroup,
        meter: BufferMeter,
    ) -> tuple[Tensor, dist.Work | None]:
        """Start the gather of ``prepared`` local blocks; returns the receive buffer and handle."""
        pieces = [prepared[m].reshape(-1).to(dtype) for ms in self.gather_send for m in ms]
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
        chunks = received.split([b.numel for pieces in self.gather_recv for _, b in pieces])
        for chunk, (m, block) in zip(chunks, (piece for pieces in self.gather_recv for piece in pieces)):
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
        """Start returning every rank's block of the computed ``directions``."""
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
        """This rank's block of each member's direction: from the scatter, or (``sync``) sliced
        out of the locally computed full directions."""
        if received is None:
            return {
                m: directions[m][self.my_blocks[m].slices] for m in self.members if self.my_blocks[m].numel
            }
        chunks = received.split([b.numel for pieces in self.scatter_recv for _, b in pieces])
        pieces = (piece for pieces in self.scatter_recv for piece in pieces)
        return {m: chunk.view(block.shape) for chunk, (m, block) in zip(chunks, pieces)}
