"""Pure planning (no torch.distributed): matrix specs → owners and micro-groups, and reports."""

from lightning_canzona.planning.devices import CollectivePrices
from lightning_canzona.planning.matrices import COST_KINDS, MatrixSpec, block_of, describe
from lightning_canzona.planning.plan import POLICIES, Plan, PlanSettings
from lightning_canzona.planning.policies import build_plan
from lightning_canzona.planning.report import PlanReport, report

__all__ = [
    "COST_KINDS",
    "POLICIES",
    "CollectivePrices",
    "MatrixSpec",
    "Plan",
    "PlanReport",
    "PlanSettings",
    "block_of",
    "build_plan",
    "describe",
    "report",
]
