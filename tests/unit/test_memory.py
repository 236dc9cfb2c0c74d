"""The step's memory model: the pipeline's order, the arena's placement, budgets and their cuts."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_canzona as lc
from lightning_canzona.planning import PlanSettings, build_plan
from lightning_canzona.planning.memory import (
    ALIGNMENT,
    MemoryBudget,
    Span,
    arena_offsets,
    parse_budget,
    pipeline_phases,
)
from lightning_canzona.planning.plan import estimated_step
from lightning_canzona.planning.policies import MEMORY_STEP_TOLERANCE
from lightning_canzona.planning.report import over_budget
from lightning_canzona.rules import MuonRule
from lightning_canzona.tools.plan.model_matrices import preset_matrices


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 12), st.integers(0, 6)), max_size=24))
def test_buffers_alive_at_once_never_share_a_byte_of_the_arena(raw) -> None:
    buffers = [Span(size, first, first + length) for size, first, length in raw]
    offsets, size = arena_offsets(buffers)
    for i, a in enumerate(buffers):
        assert offsets[i] % ALIGNMENT == 0 and offsets[i] + a.nbytes <= size
        for j, b in enumerate(buffers[:i]):
            if a.nbytes and b.nbytes and a.meets(b):
                assert offsets[i] + a.nbytes <= offsets[j] or offsets[j] + b.nbytes <= offsets[i]
    # The arena holds at least the most bytes alive at one moment, and is no bigger than all of them.
    moments = range(max((b.last for b in buffers), default=0) + 1)
    alive = max((sum(b.nbytes for b in buffers if b.first <= t <= b.last) for t in moments), default=0)
    assert alive <= size <= sum(-(-b.nbytes // ALIGNMENT) * ALIGNMENT for b in buffers)


@pytest.mark.parametrize("count", [1, 2, 5])
def test_the_pipeline_gathers_ahead_and_finishes_a_group_before_the_next_scatters(count) -> None:
    order = pipeline_phases(count, overlap=True)
    at = {step: index for index, step in enumerate(order)}
    assert sorted(order) == sorted(pipeline_phases(count, overlap=False))
    for g in range(count):
        phases = [at[phase, g] for phase in ("gather", "assemble", "compute", "scatter", "finish")]
        assert phases == sorted(phases)
        if g + 1 < count:
            assert at["gather", g + 1] < at["compute", g]  # in flight while g computes
            assert at["finish", g] < at["scatter", g + 1]  # two scatters never hold memory at once
    collectives = [step for step in order if step[0] in ("gather", "scatter")]
    expected = [("gather", 0)] + [s for g in range(count) for s in [("gather", g + 1), ("scatter", g)]]
    assert collectives == [step for step in expected if step[1] < count]


def test_a_budget_is_a_fraction_a_size_auto_or_none_and_anything_else_names_the_setting() -> None:
    assert parse_budget("auto") == MemoryBudget()
    assert parse_budget(0.25) == MemoryBudget(fraction=0.25, strict=True)
    assert parse_budget("2GiB") == MemoryBudget(fraction=None, nbytes=2 << 30, strict=True)
    assert parse_budget("512MB").bytes_for(1e12) == 512e6
    assert parse_budget(None) is None
    for wrong in ("lots", -1, 0, True):
        with pytest.raises((TypeError, ValueError), match="memory_budget"):
            lc.PlanConfig(memory_budget=wrong)


def test_a_budget_cuts_micro_groups_and_auto_only_where_the_step_stays_as_short() -> None:
    specs, _ = preset_matrices("8B", MuonRule(compute_dtype=torch.bfloat16), 8, 1)
    plans = {
        budget: build_plan(specs, 8, 1, PlanSettings(memory_budget=parse_budget(budget)))
        for budget in (None, "auto", 0.25)
    }
    peak = {budget: max(m.peak for m in plan.rank_memory()) for budget, plan in plans.items()}
    # 0.25 is below one matrix's own update here: the plan takes the least it can.
    assert peak[0.25] < peak["auto"] <= plans["auto"].memory_target() < peak[None]
    assert len(plans[None].micro_groups) < len(plans["auto"].micro_groups) < len(plans[0.25].micro_groups)
    assert estimated_step(plans["auto"]) <= (1 + MEMORY_STEP_TOLERANCE) * estimated_step(plans[None])
    # Where collectives cost more than the compute that more groups would overlap, auto keeps the plan.
    small, _ = preset_matrices("tiny-moe", MuonRule(compute_dtype=torch.bfloat16), 4, 1)
    kept = build_plan(small, 4, 1, PlanSettings(memory_budget=parse_budget("auto")))
    assert kept.micro_groups == build_plan(small, 4, 1, PlanSettings(memory_budget=None)).micro_groups


def test_a_budget_one_matrix_alone_exceeds_is_said_once_naming_the_matrix_and_the_setting() -> None:
    specs, _ = preset_matrices("small", MuonRule(compute_dtype=torch.bfloat16), 4, 1)
    tight = build_plan(specs, 4, 1, PlanSettings(memory_budget=parse_budget(0.05)))
    advice = over_budget(tight)
    assert advice is not None and "memory_budget" in advice and "alone needs" in advice, advice
    assert "mlp" in advice and "Set memory_budget to 1." in advice, advice
    # The default gives way silently; a budget the plan keeps says nothing.
    assert over_budget(build_plan(specs, 4, 1, PlanSettings())) is None
    assert over_budget(build_plan(specs, 4, 1, PlanSettings(memory_budget=parse_budget("1GiB")))) is None
