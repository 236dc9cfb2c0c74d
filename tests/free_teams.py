"""Optimizers whose plans use teams wherever they lower the bound: collectives priced at zero."""

from __future__ import annotations

import dataclasses

import lightning_canzona as lc
from lightning_canzona.planning import PlanSettings

#: The planner's prices of collectives, all zero: teams wherever they shorten the step.
FREE_TEAMS = {
    "flops_per_element": 0.0,
    "flops_per_message": 0.0,
    "exchange_flops_per_element": 0.0,
    "exchange_flops_per_message": 0.0,
}


def with_free_teams(optimizer_class):
    """``optimizer_class`` whose plan uses teams wherever they lower the bound (collectives
    priced at zero); each instance is kept in `CREATED`."""

    class WithFreeTeams(optimizer_class):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            CREATED.append(self)

        def plan_settings(self) -> PlanSettings:
            return dataclasses.replace(super().plan_settings(), **FREE_TEAMS)

    WithFreeTeams.__name__ = f"Team{optimizer_class.__name__}"
    return WithFreeTeams


TeamMuon = with_free_teams(lc.Muon)
CREATED: list[lc.MatrixOptimizer] = []
