"""Communication volume of a plan: what each rank sends and receives per optimizer step.

The model (pure arithmetic, no torch.distributed):

- Under FSDP2 × TP every matrix is sharded evenly over all ``R = dp·tp`` ranks: rank ``r`` holds
  ``N // R`` elements of an ``N``-element matrix, plus one more when ``r < N mod R``.
- Owner-based policies (``canzona``, ``lpt``, ``round_robin``): per micro-group, one fused
  all-to-all *gathers* each matrix's shards to its owner and one *scatters* the update shards back.
  In the gather a rank sends its shard of every matrix it does not own and receives the other
  ranks' shards (``N`` minus its own) of every matrix it owns; the scatter is the mirror image.
- ``sync``: every matrix is all-gathered to every rank: each rank receives ``N`` minus its own
  shard and sends its shard to the ``R − 1`` others; there is no scatter, since every rank
  computed the whole update itself.

A matrix that some ranks hold whole (`MatrixSpec.holders`: an expert that FSDP2 left on one
rank) is sent by the first of them alone: nothing when its owner is a holder, the whole matrix to
an owner elsewhere (and to every other rank under ``sync``).

Bytes are elements times the size of the exchange dtype (the rule's ``exchange_dtype``).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_canzona.planning.plan import Plan


def shard_numel(numel: int, num_ranks: int, rank: int) -> int:
    """Elements of an ``numel``-element matrix that ``rank`` holds under an even split."""
    base, extra = divmod(numel, num_ranks)
    return base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class Exchange:
    """One collective (a micro-group's gather or scatter) seen from every rank.

    Attributes:
        sent: Bytes each rank sends.
        received: Bytes each rank receives.
        peers: Distinct ranks each rank exchanges a message with (either direction): what a
            latency model charges per message.
    """

    sent: list[int]
    received: list[int]
    peers: list[int]

    @property
    def busiest(self) -> int:
        """The largest one-directional volume of any rank: what bounds the collective's time."""
        return max(max(self.sent, default=0), max(self.received, default=0))

    @property
    def max_peers(self) -> int:
        return max(self.peers, default=0)


@dataclass(frozen=True)
class Traffic:
    """Per-step communication of a plan.

    Attributes:
        element_bytes: Bytes per exchanged element.
        gathers: The gather (all-to-all, or all-gather under ``sync``) of each micro-group.
        scatters: The scatter of each micro-group (all zero under ``sync``).
    """

    element_bytes: int
    gathers: list[Exchange]
    scatters: list[Exchange]

    def _total(self, field: str) -> list[int]:
        exchanges = self.gathers + self.scatters
        num_ranks = len(exchanges[0].sent) if exchanges else 0
        return [sum(getattr(e, field)[rank] for e in exchanges) for rank in range(num_ranks)]

    @property
    def rank_sent(self) -> list[int]:
        """Bytes each rank sends per step, gathers and scatters together."""
        return self._total("sent")

    @property
    def rank_received(self) -> list[int]:
        """Bytes each rank receives per step, gathers and scatters together."""
        return self._total("received")

    @property
    def rank_bytes(self) -> list[int]:
        """Bytes each rank sends plus receives per step."""
        return [s + r for s, r in zip(self.rank_sent, self.rank_received)]


def traffic(plan: Plan, element_bytes: int) -> Traffic:
    """The communication of ``plan`` when every element travels as ``element_bytes`` bytes."""
    if element_bytes < 1:
        raise ValueError(f"element_bytes must be >= 1, got {element_bytes}")
    num_ranks = plan.num_ranks
    gathers, scatters = [], []
    for group in plan.micro_groups:
        if plan.owners is None:
            gathers.append(_all_gather(plan, group, element_bytes))
            scatters.append(Exchange([0] * num_ranks, [0] * num_ranks, [0] * num_ranks))
        else:
            gather = _owner_gather(plan, group, element_bytes)
            gathers.append(gather)
            # The scatter moves the same shards the other way.
            scatters.append(Exchange(gather.received, gather.sent, gather.peers))
    return Traffic(element_bytes, gathers, scatters)


def _owner_gather(plan: Plan, group: tuple[int, ...], element_bytes: int) -> Exchange:
    num_ranks = plan.num_ranks
    sent, received = [0] * num_ranks, [0] * num_ranks
    partners: list[set[int]] = [set() for _ in range(num_ranks)]
    assert plan.teams is not None
    for index in group:
        team = plan.teams[index]
        for rank, shard in enumerate(_held(plan, index, team[0])):
            # A team's members each take their slice's share of every shard.
            for member in team:
                share = shard // len(team) + (member - team[0] < shard % len(team))
                if rank == member or share == 0:
                    continue
                sent[rank] += share * element_bytes
                received[member] += share * element_bytes
                partners[rank].add(member)
                partners[member].add(rank)
    return Exchange(sent, received, [len(p) for p in partners])


def _held(plan: Plan, index: int, owner: int | None = None) -> list[int]:
    """Elements of matrix ``index`` that each rank sends when it is gathered (to ``owner``, or
    to everyone): its even share, or all of it from one rank that holds it whole: the owner
    itself if it is one (then nothing travels), else the first."""
    matrix, num_ranks = plan.matrices[index], plan.num_ranks
    if matrix.holders:
        sender = owner if owner in matrix.holders else matrix.holders[0]
        return [matrix.cost.numel if rank == sender else 0 for rank in range(num_ranks)]
    return [shard_numel(matrix.cost.numel, num_ranks, rank) for rank in range(num_ranks)]


def _all_gather(plan: Plan, group: tuple[int, ...], element_bytes: int) -> Exchange:
    num_ranks = plan.num_ranks
    total = sum(plan.matrices[index].cost.numel for index in group)
    held = [_held(plan, index) for index in group]
    own = [sum(shares[rank] for shares in held) for rank in range(num_ranks)]
    return Exchange(
        sent=[(num_ranks - 1) * shard * element_bytes for shard in own],
        received=[(total - shard) * element_bytes for shard in own],
        peers=[num_ranks - 1 if total else 0] * num_ranks,
    )
