"""The one configuration of the plan, as a LightningCLI config and ``--help`` read it."""

from __future__ import annotations

import dataclasses
import io
from contextlib import redirect_stdout

import pytest
from jsonargparse import ArgumentParser

import lightning_canzona as lc


def _parser() -> ArgumentParser:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(lc.CanzonaStrategy, "strategy")
    return parser


def test_a_config_file_sets_the_plan_of_the_strategy() -> None:
    parser = _parser()
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # 4.49 renamed it
    config = parser.parse_string("strategy:\n  plan:\n    policy: lpt\n    team_prices: [1, 2]\n")
    strategy = instantiate(config).strategy
    assert strategy.plan_config == lc.PlanConfig(policy="lpt", team_prices=(1.0, 2.0))
    assert instantiate(parser.parse_args([])).strategy.plan_config is None


def test_help_shows_every_plan_setting_with_its_description() -> None:
    shown = io.StringIO()
    with redirect_stdout(shown), pytest.raises(SystemExit):
        _parser().parse_args(["--strategy.plan.help"])
    for field in dataclasses.fields(lc.PlanConfig):
        assert f"--strategy.plan.{field.name}" in shown.getvalue()
    assert "Pipeline the micro-groups" in shown.getvalue()  # the docstring of `overlap`
