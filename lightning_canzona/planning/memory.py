"""Memory of a step: the buffers each micro-group holds on each rank, where they lie in one arena,
the rank's peak, and micro-groups cut to a budget (docs/memory.md)."""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from lightning_canzona.planning.matrices import MatrixSpec

#: Every buffer of the arena starts at a multiple of this many bytes (the CUDA caching allocator's
#: granularity): any dtype's view of it is aligned for every kernel.
ALIGNMENT = 512

#: The phases of one micro-group, in the order one group runs them.
PHASES = ("gather", "assemble", "compute", "scatter", "finish")

#: What happens in each phase, in order, as the buffers' lives count it: a gather's send buffer is
#: free once the gather is waited for, so that the assembly may write where it lay; the stack is
#: free once packed for the scatter, so that the scatter may receive where it lay.
MOMENTS = {
    "gather": ("launch_gather",),
    "assemble": ("wait_gather", "assemble"),
    "compute": ("compute",),
    "scatter": ("pack", "launch_scatter"),
    "finish": ("finish",),
}

#: The default budget of a step's buffers: half the bytes of the matrices a rank holds. With Muon's
#: one momentum, state and step together then stay at three quarters of AdamW's two moments.
DEFAULT_BUDGET = 0.5


def pipeline_phases(count: int, overlap: bool) -> list[tuple[str, int]]:
    """``(phase, group)`` in the order the step runs them: with ``overlap``, ``gather 0, gather 1,
    assemble 0, compute 0, scatter 0, gather 2, assemble 1, compute 1, finish 0, scatter 1, …``: the
    next group's gather and the previous group's scatter in flight while a group computes, and
    each group finished before the next scatters, so that two groups' scatters never hold memory
    at once."""
    if not overlap:
        return [(phase, group) for group in range(count) for phase in PHASES]
    order = [("gather", 0)] if count else []
    for group in range(count):
        if group + 1 < count:
            order.append(("gather", group + 1))
        order += [("assemble", group), ("compute", group)]
        if group > 0:
            order.append(("finish", group - 1))
        order.append(("scatter", group))
    if count:
        order.append(("finish", count - 1))
    return order


@dataclass(frozen=True)
class GroupBuffers:
    """Bytes one rank holds for one micro-group.

    Attributes:
        gather_send, gather_receive: The gather's packed buffers (from the gather to the assembly).
        own: The pieces of its local shards that it computes itself (from the gather to the assembly).
        assembled: The full matrices (or team slices) it computes, stacked per batch, then their
            directions in their place (from the assembly to the scatter).
        scatter_send, scatter_receive: The scatter's packed buffers (from the scatter to the finish).
        kept: The pieces of its directions that are its own updates (from the scatter to the finish).
        prepared: Its local shards after the rule's elementwise part (at the gather).
        working: The rule's own temporaries and output for the group's largest batch (the compute).
    """

    gather_send: int = 0
    gather_receive: int = 0
    own: int = 0
    assembled: int = 0
    scatter_send: int = 0
    scatter_receive: int = 0
    kept: int = 0
    prepared: int = 0
    working: int = 0

    #: What the step places in its arena; the rest the rules allocate.
    ARENA = ("gather_send", "gather_receive", "own", "assembled", "scatter_send", "scatter_receive", "kept")
    #: The first and the last of the `MOMENTS` that each buffer lives in.
    LIVES = {
        "gather_send": ("launch_gather", "wait_gather"),
        "gather_receive": ("launch_gather", "assemble"),
        "own": ("launch_gather", "assemble"),
        "assembled": ("assemble", "pack"),
        "scatter_send": ("pack", "finish"),
        "kept": ("pack", "finish"),
        "scatter_receive": ("launch_scatter", "finish"),
        "prepared": ("launch_gather", "launch_gather"),
        "working": ("compute", "compute"),
    }


@dataclass(frozen=True)
class Span:
    """A buffer: its bytes and the first and last moments (indices of `moments`) it lives in."""

    nbytes: int
    first: int
    last: int

    def meets(self, other: Span) -> bool:
        return self.first <= other.last and other.first <= self.last


def moments(count: int, overlap: bool) -> list[tuple[str, int]]:
    """``(moment, group)`` in the order the step runs them: `pipeline_phases`, each phase's `MOMENTS`."""
    return [(moment, group) for phase, group in pipeline_phases(count, overlap) for moment in MOMENTS[phase]]


def spans(groups: Sequence[GroupBuffers], overlap: bool, names: Sequence[str]) -> list[list[Span]]:
    """Per group, a `Span` of each buffer of ``names`` (in that order), timed by `moments`."""
    at = {step: index for index, step in enumerate(moments(len(groups), overlap))}
    return [
        [
            Span(
                getattr(buffers, name), at[GroupBuffers.LIVES[name][0], g], at[GroupBuffers.LIVES[name][1], g]
            )
            for name in names
        ]
        for g, buffers in enumerate(groups)
    ]


def arena_offsets(buffers: Sequence[Span]) -> tuple[list[int], int]:
    """Offsets of ``buffers`` in one arena, buffers alive at once never overlapping, and its bytes.

    Largest first, each at the lowest aligned offset free for its whole life (the greedy of static
    memory planners): the arena is the step's peak of these buffers, or little more.
    """
    offsets = [0] * len(buffers)
    placed: list[int] = []
    size = 0
    for index in sorted(range(len(buffers)), key=lambda i: (-buffers[i].nbytes, i)):
        buffer = buffers[index]
        if not buffer.nbytes:
            continue
        offset = 0
        for other in sorted((i for i in placed if buffers[i].meets(buffer)), key=offsets.__getitem__):
            if offset + buffer.nbytes <= offsets[other]:
                break
            offset = max(offset, _aligned(offsets[other] + buffers[other].nbytes))
        offsets[index] = offset
        placed.append(index)
        size = max(size, offset + buffer.nbytes)
    return offsets, size


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


@dataclass(frozen=True)
class StepMemory:
    """What one rank holds in a step, in bytes.

    Attributes:
        arena: The step's packed and assembled buffers, placed by `arena_offsets`.
        peak: The most bytes alive at once: the arena and what the rules allocate beside it.
        groups: Per micro-group, what the rank holds for it.
    """

    arena: int
    peak: int
    groups: tuple[GroupBuffers, ...]


def arena_layout(groups: Sequence[GroupBuffers], overlap: bool) -> tuple[list[dict[str, int]], int]:
    """Per group, the offset of each of its `GroupBuffers.ARENA` buffers in the step's arena, and the
    arena's bytes, for groups run as `pipeline_phases`."""
    lives = spans(groups, overlap, GroupBuffers.ARENA)
    offsets, size = arena_offsets([span for group in lives for span in group])
    width = len(GroupBuffers.ARENA)
    return [
        dict(zip(GroupBuffers.ARENA, offsets[g * width : (g + 1) * width])) for g in range(len(groups))
    ], size


@functools.lru_cache(maxsize=4096)
def step_memory(groups: tuple[GroupBuffers, ...], overlap: bool) -> StepMemory:
    """The arena and peak of one rank whose micro-groups hold ``groups``, run as `pipeline_phases`
    (cached: ranks of one plan often hold alike)."""
    _, arena = arena_layout(groups, overlap)
    others = [name for name in GroupBuffers.LIVES if name not in GroupBuffers.ARENA]
    rule_spans = [span for group in spans(groups, overlap, others) for span in group]
    count = len(moments(len(groups), overlap))
    alive = [sum(s.nbytes for s in rule_spans if s.first <= moment <= s.last) for moment in range(count)]
    return StepMemory(arena, arena + max(alive, default=0), tuple(groups))


@dataclass(frozen=True)
class MemoryBudget:
    """How many bytes a rank's step buffers may hold at their peak.

    Attributes:
        fraction: Of the bytes of the matrices a rank holds (``None``: ``nbytes`` is set).
        nbytes: Bytes, whatever the matrices (``None``: ``fraction`` is set).
        strict: A budget the user chose: the plan cuts toward it whatever it costs in time, and
            the optimizer warns once where it cannot be kept. The default gives way to speed and
            to one matrix's needs silently.
    """

    fraction: float | None = DEFAULT_BUDGET
    nbytes: int | None = None
    strict: bool = False

    def __post_init__(self) -> None:
        if (self.fraction is None) == (self.nbytes is None):
            raise ValueError("memory_budget needs either a fraction or a number of bytes")
        if self.fraction is not None and not self.fraction > 0:
            raise ValueError(f"memory_budget must be > 0, got {self.fraction}")
        if self.nbytes is not None and not self.nbytes > 0:
            raise ValueError(f"memory_budget must be > 0 bytes, got {self.nbytes}")

    def bytes_for(self, matrix_bytes: float) -> float:
        """The budget of a rank that holds ``matrix_bytes`` of matrices."""
        return self.nbytes if self.nbytes is not None else self.fraction * matrix_bytes  # type: ignore[operator]

    def describe(self) -> str:
        if self.nbytes is not None:
            return size_text(self.nbytes)
        return f"{self.fraction:g} of the rank's matrix bytes"


def size_text(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit that keeps it at least 1 (``"812.0 MiB"``)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def parse_budget(value: float | str | None) -> MemoryBudget | None:
    """The budget of ``memory_budget``: ``"auto"`` (the default fraction), a fraction of the rank's
    matrix bytes (``0.5``), a size (``"2GiB"``, ``"512MB"``), or ``None`` (no bound)."""
    if value is None:
        return None
    if value == "auto":
        return MemoryBudget()
    if isinstance(value, bool):
        raise TypeError(
            f"memory_budget must be a fraction, a size such as '2GiB', 'auto' or None, got {value!r}"
        )
    if isinstance(value, (int, float)):
        return MemoryBudget(fraction=float(value), strict=True)
    text = str(value).strip().replace(" ", "")
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9}
    units.update({"TB": 10**12, "B": 1})
    for unit, scale in units.items():
        if text.lower().endswith(unit.lower()):
            try:
                return MemoryBudget(fraction=None, nbytes=int(float(text[: -len(unit)]) * scale), strict=True)
            except ValueError:
                break
    try:
        return MemoryBudget(fraction=float(text), strict=True)
    except ValueError:
        raise ValueError(
            f"memory_budget must be 'auto', a fraction of the rank's matrix bytes such as 0.5, a size "
            f"such as '2GiB' or '512MB', or None, got {value!r}"
        ) from None


def split_groups(
    groups: Sequence[tuple[int, ...]], sizes: Sequence[dict[int, int]], limit: float
) -> list[tuple[int, ...]]:
    """``groups`` cut so that no rank holds more than ``limit`` bytes of any one group: each group's
    members, largest first, into the first of its parts with room on every rank that computes it
    (``sizes[i]``: rank → bytes of matrix ``i``). A matrix above ``limit`` alone is a part alone."""
    cut: list[tuple[int, ...]] = []
    for group in groups:
        parts: list[list[int]] = []
        held: list[dict[int, int]] = []
        for index in sorted(group, key=lambda i: (-max(sizes[i].values(), default=0), i)):
            part = next(
                (
                    p
                    for p, ranks in enumerate(held)
                    if all(ranks.get(rank, 0) + nbytes <= limit for rank, nbytes in sizes[index].items())
                ),
                None,
            )
            if part is None:
                part = len(parts)
                parts.append([])
                held.append({})
            parts[part].append(index)
            for rank, nbytes in sizes[index].items():
                held[part][rank] = held[part].get(rank, 0) + nbytes
        cut += [tuple(sorted(part)) for part in parts]
    return cut


def shrink_limits(largest: float, smallest: float) -> list[float]:
    """Per-group limits to try, from ``largest`` down to ``smallest``, each a little below the last."""
    limits, limit = [], largest
    while limit > smallest and len(limits) < 24:
        limits.append(limit)
        limit *= 0.75
    return [*limits, smallest] if smallest > 0 else limits


def nearest_fit(peaks: Sequence[float], budget: float) -> int:
    """The first of ``peaks`` within ``budget``, else the least."""
    within = [index for index, peak in enumerate(peaks) if peak <= budget]
    return within[0] if within else min(range(len(peaks)), key=lambda i: (peaks[i], i))


def estimated_buffers(
    matrices: Sequence[MatrixSpec],
    teams: Sequence[tuple[int, ...]] | None,
    groups: Sequence[Sequence[int]],
    num_ranks: int,
) -> list[list[GroupBuffers]]:
    """Per rank, per micro-group, the bytes the step holds for it, as the runtime lays them out.

    A matrix's shards are even over the ranks (whole on its ``holders``, the first sending them); a
    team member computes a ``1/size`` slice, of which it holds its share already. Under ``sync``
    (``teams is None``) every rank computes every matrix and nothing is scattered. Each rank's batches
    are its matrices of one shape and team size where the rule batches them (one call of the rule).
    """
    per_rank: list[list[GroupBuffers]] = [[] for _ in range(num_ranks)]
    for group in groups:
        common, by_rank = _group_buffers(
            [matrices[i] for i in group], teams and [teams[i] for i in group], num_ranks
        )
        for rank in range(num_ranks):
            per_rank[rank].append(by_rank.get(rank, common))
    return per_rank


def _group_buffers(
    matrices: Sequence[MatrixSpec], teams: Sequence[tuple[int, ...]] | None, num_ranks: int
) -> tuple[GroupBuffers, dict[int, GroupBuffers]]:
    """One micro-group's `GroupBuffers`: of a rank that only holds even shards of its ``matrices``,
    and of each rank that holds more or computes some."""
    fields = [name for name in GroupBuffers.LIVES if name != "working"]
    shared = dict.fromkeys(fields, 0.0)
    sums: dict[int, dict[str, float]] = {}
    batches: dict[int, dict[Hashable, int]] = {}
    common_batches: dict[Hashable, int] = {}  # under sync, every rank's

    def add(rank: int, name: str, nbytes: float) -> None:
        sums.setdefault(rank, dict.fromkeys(fields, 0.0))[name] += nbytes

    for index, matrix in enumerate(matrices):
        numel, xb = matrix.cost.numel, matrix.exchange_bytes
        even = numel / num_ranks
        working = matrix.cost.working_bytes + round(numel * xb)
        if teams is None:  # every rank computes the whole matrix alike; its holders hold it already
            shared["assembled"] += numel * xb
            if matrix.holders:
                for rank in matrix.holders:
                    add(rank, "prepared", numel * matrix.prepared_bytes)
                    for name in ("own", "kept"):
                        add(rank, name, numel * xb)
                    add(rank, "gather_receive", -numel * xb)
                add(matrix.holders[0], "gather_send", numel * xb * (num_ranks - len(matrix.holders)))
                shared["gather_receive"] += numel * xb
            else:
                shared["prepared"] += even * matrix.prepared_bytes
                shared["gather_send"] += even * xb * (num_ranks - 1)
                shared["gather_receive"] += (numel - even) * xb
                shared["own"] += even * xb
                shared["kept"] += even * xb
            key = (matrix.shape, 1) if matrix.batched else index
            common_batches[key] = common_batches.get(key, 0) + working
            continue
        team = teams[index]
        size = len(team)
        computed = numel / size
        working = matrix.member_cost(size).working_bytes + round(computed * xb)
        if matrix.holders:  # each holder prepares its copy; the first sends slices to the others
            for rank in matrix.holders:
                add(rank, "prepared", numel * matrix.prepared_bytes)
                # and gets back every slice that another rank computed
                add(rank, "scatter_receive", (numel - (computed if rank in team else 0.0)) * xb)
            outside = sum(rank not in matrix.holders for rank in team)
            add(matrix.holders[0], "gather_send", computed * xb * outside)
        else:
            shared["prepared"] += even * matrix.prepared_bytes
            shared["gather_send"] += even * xb
            shared["scatter_receive"] += even * xb
        for rank in team:
            if matrix.holders:
                mine = computed if rank in matrix.holders else 0.0
                returned = computed * (len(matrix.holders) - (rank in matrix.holders))
            else:
                mine = even / size
                returned = computed - mine
                # its own piece neither leaves nor comes back
                add(rank, "gather_send", -mine * xb)
                add(rank, "scatter_receive", -mine * xb)
            add(rank, "scatter_send", returned * xb)
            for name, nbytes in (("assembled", computed), ("gather_receive", computed - mine)):
                add(rank, name, nbytes * xb)
            add(rank, "kept", mine * xb)
            add(rank, "own", mine * xb)
            rank_batches = batches.setdefault(rank, {})
            key = (matrix.shape, size) if matrix.batched else index
            rank_batches[key] = rank_batches.get(key, 0) + working

    def buffers(values: dict[str, float], working: int) -> GroupBuffers:
        return GroupBuffers(**{name: round(value) for name, value in values.items()}, working=working)

    common = max(common_batches.values(), default=0)
    by_rank = {
        rank: buffers(
            {name: shared[name] + values[name] for name in fields},
            max(batches.get(rank, {}).values(), default=common),
        )
        for rank, values in sums.items()
    }
    return buffers(shared, common), by_rank
