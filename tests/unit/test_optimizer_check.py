"""The optimizers of ``configure_optimizers`` built once in the launching process: an optimizer's
refusal of its settings is raised there; anything else is left to the ranks, and the call leaves
nothing behind (`lightning_canzona.optimizer_check`)."""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning import LightningModule, Trainer
from torch import nn

import lightning_canzona as lc
from lightning_canzona.optimizer_check import check_optimizer_settings


class Model(LightningModule):
    """A LightningModule whose ``configure_optimizers`` is the test's ``build(self)``."""

    def __init__(self, build, layers: int = 1) -> None:
        super().__init__()
        self.build = build
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(layers))

    def configure_optimizers(self):
        return self.build(self)


def _muon(**settings):
    return lambda model: lc.Muon(lc.matrix_param_groups(model), **settings)


@pytest.mark.parametrize(
    "build, error, message",
    [
        (_muon(wieght_decay=0.1), TypeError, r"^Muon\(\) got an unexpected keyword argument 'wieght_decay'"),
        (_muon(momentum=1.5), ValueError, r"^param_groups\[0\] \(muon\): momentum must lie in \[0, 1\)"),
        (_muon(ns_coefficients="quinitc"), ValueError, r"quinitc"),
        (
            lambda model: torch.optim.AdamW(model.parameters(), wieght_decay=0.1),
            TypeError,
            r"^AdamW.__init__\(\) got an unexpected keyword argument 'wieght_decay'",
        ),
        (lambda model: torch.optim.AdamW(model.parameters(), lr=-1.0), ValueError, r"^Invalid learning rate"),
    ],
    ids=["lc-keyword", "lc-value", "lc-preset", "torch-keyword", "torch-value"],
)
def test_an_optimizers_refusal_of_its_settings_is_raised(build, error, message) -> None:
    with pytest.raises(error, match=message):
        check_optimizer_settings(Model(build))


def _needs_the_trainer(model):
    steps = model.trainer.estimated_stepping_batches  # the trainer is not attached before launch
    return lc.Muon(lc.matrix_param_groups(model), wieght_decay=steps)


def _needs_a_process_group(model):
    # ZeroRedundancyOptimizer asks torch.distributed for its rank: a ValueError before launch.
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW)


@pytest.mark.parametrize(
    "build, layers",
    [
        (_needs_the_trainer, 1),
        (_needs_a_process_group, 1),
        (lambda model: torch.optim.AdamW(model.layers.parameters()), 0),  # configure_model makes them
        (lambda model: lc.Muon(model.backbone.parameters()), 1),  # an attribute configure_model sets
    ],
    ids=["trainer", "process-group", "no-parameters-yet", "missing-attribute"],
)
def test_what_only_the_ranks_can_build_is_left_to_them(build, layers) -> None:
    check_optimizer_settings(Model(build, layers))


def test_the_call_leaves_no_trace(capsys, recwarn) -> None:
    seen = {}

    def build(model):
        try:
            seen["trainer"] = model.trainer
        except RuntimeError:
            seen["trainer"] = None
        print("building the optimizer")
        torch.nn.init.normal_(torch.empty(8))
        warnings.warn("a warning of the user's", UserWarning, stacklevel=1)
        return lc.Muon(lc.matrix_param_groups(model), lr=0.02)

    model = Model(build)
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    model.trainer = trainer
    random_state = torch.get_rng_state()
    check_optimizer_settings(model)
    assert seen == {"trainer": None}  # detached meanwhile
    assert model.trainer is trainer  # and attached again
    assert torch.equal(torch.get_rng_state(), random_state)
    assert capsys.readouterr() == ("", "")
    assert not [w for w in recwarn if "the user's" in str(w.message)]
