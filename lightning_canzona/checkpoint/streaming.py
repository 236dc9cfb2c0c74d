"""Every owner's matrix state to rank 0's host in chunks of bounded size, for a single-file save.

A single file holds the matrix state that only each matrix's owner keeps (Shampoo's and SOAP's
factors and bases). Gathered as pickled objects, all of it would be staged on rank 0's device at
once (NCCL's object collectives do), more than rank 0 may have room for. `stream_to_rank_zero`
instead:

1. exchanges what each rank holds: names, keys, shapes, dtypes (`layout_of`, a few bytes a tensor);
2. lays each owner's tensors end to end, in that order, and cuts them into chunks of at most
   `CHUNK_BYTES` (`plan_chunks`); each chunk is one broadcast from its owner through a buffer on
   the process group's device (NCCL takes no host tensor), which rank 0 copies into the host
   tensors it returns. Rank 0's own state goes straight to its host.

Rank 0's device holds one buffer; each owner's, its own state (held already) and one buffer. A
broadcast, not ``send``/``recv``: NCCL opens a communicator for every pair of ranks that exchange
point to point, and rank 0 would open one per owner. Each chunk carries a status byte: an owner
that failed to fill it says so, and every rank stops after that chunk. Each phase ends with the
ranks agreeing on any failure (`lightning_canzona.checkpoint.errors.on_every_rank`): a failure on
one rank is an error on every rank, in seconds, never a rank left waiting in a broadcast.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_canzona.checkpoint.errors import on_every_rank
from lightning_canzona.distributed.agreement import wait_for

#: The most bytes of the device buffer that a single-file save streams owners' state through: a
#: chunk of state and its status byte. Large enough that each broadcast's fixed cost (a kernel
#: launch, the ranks' handshake) is small next to moving the chunk at a link's bandwidth; small
#: next to an accelerator's memory (under 0.1 % of an 80 GB GPU's).
CHUNK_BYTES = 64 << 20

#: Name, key, shape and dtype of each tensor a rank holds, by parameter name, then state key.
Layout = dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]]
#: Tensors by parameter name, then state key: a rank's matrix state.
Held = dict[str, dict[str, Tensor]]

_SAVING = "Saving the checkpoint"


@dataclass(frozen=True)
class Span:
    """Bytes ``start:stop`` of the ``index``-th tensor of an owner's stream, at ``offset`` in a chunk."""

    index: int
    start: int
    stop: int
    offset: int

    @property
    def in_tensor(self) -> slice:
        """Where its bytes are in their tensor's."""
        return slice(self.start, self.stop)

    @property
    def in_chunk(self) -> slice:
        """Where its bytes are in the chunk."""
        return slice(self.offset, self.offset + self.stop - self.start)


@dataclass(frozen=True)
class Chunk:
    """What one broadcast carries: consecutive spans of an owner's tensors, packed end to end."""

    spans: tuple[Span, ...]

    @property
    def nbytes(self) -> int:
        """The bytes of state it carries."""
        last = self.spans[-1]
        return last.offset + last.stop - last.start


def layout_of(held: Held) -> Layout:
    """What ``held`` is made of, without its values: what the ranks exchange before streaming."""
    return {
        name: {key: (tuple(tensor.shape), tensor.dtype) for key, tensor in state.items()}
        for name, state in held.items()
    }


def tensor_sizes(layout: Layout) -> list[int]:
    """The bytes of each tensor of ``layout``, in stream order."""
    return [math.prod(shape) * dtype.itemsize for state in layout.values() for shape, dtype in state.values()]


def plan_chunks(sizes: Sequence[int], capacity: int) -> list[Chunk]:
    """Cut tensors of ``sizes`` bytes, laid end to end, into chunks of at most ``capacity`` bytes:
    small tensors share a chunk, a large one spans several, an empty one is in none."""
    if capacity < 1:
        raise ValueError(f"A chunk must hold at least one byte, got a capacity of {capacity}.")
    chunks: list[Chunk] = []
    spans: list[Span] = []
    filled = 0
    for index, size in enumerate(sizes):
        start = 0
        while start < size:
            stop = min(size, start + capacity - filled)
            spans.append(Span(index, start, stop, filled))
            filled += stop - start
            start = stop
            if filled == capacity:
                chunks.append(Chunk(tuple(spans)))
                spans, filled = [], 0
    if spans:
        chunks.append(Chunk(tuple(spans)))
    return chunks


def stream_to_rank_zero(held: Held, device: torch.device, chunk_bytes: int = CHUNK_BYTES) -> list[Held]:
    """Every rank's ``held`` tensors, copied to rank 0's host (collective).

    Args:
        held: This rank's tensors, on ``device``.
        device: The device the process group communicates on (a GPU for NCCL, the CPU for gloo).
        chunk_bytes: The size of the buffer each rank streams through (see `CHUNK_BYTES`).

    Returns:
        On rank 0, each rank's ``held`` in rank order, as CPU tensors; elsewhere an empty list.

    Raises:
        Exception: On every rank when any rank failed (its own error on that rank; elsewhere a
            ``RuntimeError`` naming it): after the chunk in flight, with nothing of it returned.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    layouts: list[Layout] = [{} for _ in range(world)]
    dist.all_gather_object(layouts, layout_of(held))
    plans = [plan_chunks(tensor_sizes(layout), chunk_bytes - 1) for layout in layouts]
    plans[0] = []  # rank 0's own state is copied, not streamed
    largest = max((chunk.nbytes for plan in plans for chunk in plan), default=0)

    def prepare() -> _Ends:
        # Every allocation of the save, before its first chunk: a failure is agreed on at once.
        buffer = torch.empty(largest + 1, dtype=torch.uint8, device=device)
        received = [_host_tensors(layout) for layout in layouts] if rank == 0 else []
        if rank == 0:
            for name, state in held.items():
                for key, tensor in state.items():
                    received[0][name][key].copy_(tensor)
        return _Ends(buffer, _bytes_of_each(held), [_bytes_of_each(one) for one in received], received)

    ends = on_every_rank(prepare, what=_SAVING)
    on_every_rank(lambda: _stream(ends, plans, rank), what=_SAVING)
    return ends.received


@dataclass(frozen=True)
class _Ends:
    """This rank's ends of the stream: its buffer, the bytes it sends, where rank 0 copies each
    rank's bytes to (``targets``, views of ``received``)."""

    buffer: Tensor
    sources: list[Tensor]
    targets: list[list[Tensor]]
    received: list[Held]


def _stream(ends: _Ends, plans: Sequence[Sequence[Chunk]], rank: int) -> None:
    """Broadcast every owner's chunks in turn, rank 0 copying each to its host, then raise this
    rank's failure. An owner that fails to fill a chunk marks it, and every rank stops after it;
    rank 0, failing to copy one, goes on joining the broadcasts."""
    failure: Exception | None = None
    for owner, chunk in ((owner, chunk) for owner, plan in enumerate(plans) for chunk in plan):
        part = ends.buffer[: chunk.nbytes + 1]  # the chunk, then its status byte
        if rank == owner:
            try:
                _pack(chunk, ends.sources, part)
            except Exception as error:
                failure = error
            part[-1] = failure is not None
        wait_for(dist.broadcast, part, src=owner)
        if part[-1].item():  # its owner failed: every rank stops here
            break
        if rank == 0 and failure is None:
            try:
                _unpack(part, chunk, ends.targets[owner])
            except Exception as error:
                failure = error
    if failure is not None:
        raise failure


def _pack(chunk: Chunk, sources: Sequence[Tensor], part: Tensor) -> None:
    """Copy the bytes of ``chunk`` from this owner's tensors into ``part``."""
    for span in chunk.spans:
        part[span.in_chunk].copy_(sources[span.index][span.in_tensor])


def _unpack(part: Tensor, chunk: Chunk, targets: Sequence[Tensor]) -> None:
    """Copy the bytes of ``chunk`` from ``part`` into the owner's tensors on rank 0's host."""
    for span in chunk.spans:
        targets[span.index][span.in_tensor].copy_(part[span.in_chunk])


def _bytes_of_each(held: Held) -> list[Tensor]:
    """The bytes of each tensor of ``held`` in stream order, flat views (of a copy, where a tensor
    is not contiguous)."""
    return [
        tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        for state in held.values()
        for tensor in state.values()
    ]


def _host_tensors(layout: Layout) -> Held:
    """Uninitialized CPU tensors of ``layout``."""
    return {
        name: {key: torch.empty(shape, dtype=dtype) for key, (shape, dtype) in state.items()}
        for name, state in layout.items()
    }
