"""``Fabric(strategy="canzona")``: a hand-written loop trains exactly as one process does.

The loop (`fabric_loop.py`) runs as a user runs it, as a script whose ranks Fabric starts by
re-running it; the reference runs the same loop here on the whole model with `lc.Muon` and
``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fabric_loop import ACCUMULATE, MAX_NORM, MUON, batches, loss_of
from lightning.fabric import Fabric

import lightning_canzona as lc
from lightning_canzona.models.qwen3 import Qwen3

LOOP = Path(__file__).with_name("fabric_loop.py")


def _one_process() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[float]]:
    torch.manual_seed(0)
    model = Qwen3("tiny")
    initial = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    optimizer = lc.Muon(lc.matrix_param_groups(model), **MUON)
    norms = []
    for micro_batches in batches().split(ACCUMULATE):
        for tokens in micro_batches:
            loss_of(model, tokens).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    return initial, model.state_dict(), norms


@pytest.mark.parametrize(
    ("dp", "tp", "setup"),
    [("auto", "auto", "joint"), ("4", "1", "separate")],
    ids=["auto-dp2xtp2-setup", "dp4-setup_module-setup_optimizers"],
)
def test_a_fabric_loop_trains_the_bundled_model_exactly(tmp_path, dp, tp, setup) -> None:
    out = tmp_path / "trained.pt"
    run = subprocess.run(
        [sys.executable, str(LOOP), str(out), dp, tp, setup],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    expected_mesh = (
        "data_parallel 2 × tensor_parallel 2" if dp == "auto" else "data_parallel 4 × tensor_parallel 1"
    )
    printed = run.stdout + run.stderr
    assert f"lightning_canzona: device mesh {expected_mesh}" in printed
    assert "lightning_canzona plan on mesh" in printed
    assert "warn" not in printed.lower(), printed[-3000:]
    trained = torch.load(out)
    initial, expected, expected_norms = _one_process()
    # The norms before clipping (clipping fired: they exceed MAX_NORM), then the weights, with the
    # bounds of the transformers tests: data parallelism alone reorders no sum; tensor
    # parallelism sums partial products in another order, float32 noise Newton-Schulz amplifies.
    assert min(expected_norms) > MAX_NORM
    assert trained["norms"] == pytest.approx(expected_norms, rel=1e-5)
    tolerance = 1e-6 if tp == "1" else 3e-5
    ulps = 16 * torch.finfo(torch.float32).eps
    assert trained["weights"].keys() == expected.keys()
    for name, weight in expected.items():
        update, expected_update = trained["weights"][name] - initial[name], weight - initial[name]
        bound = tolerance * float(expected_update.norm()) + ulps * float(initial[name].norm())
        assert float((update - expected_update).norm()) <= bound, name


def test_fabric_takes_the_strategy_by_name_and_checks_its_sizes_before_any_rank_starts() -> None:
    assert isinstance(
        Fabric(accelerator="cpu", devices=4, strategy="canzona").strategy, lc.CanzonaFabricStrategy
    )
    with pytest.raises(ValueError, match=r"data_parallel_size=3 does not divide the 4 devices"):
        Fabric(accelerator="cpu", devices=4, strategy=lc.CanzonaFabricStrategy(data_parallel_size=3))
    with pytest.raises(TypeError, match="plan must be a lightning_canzona.PlanConfig"):
        lc.CanzonaFabricStrategy(plan={"policy": "lpt"})
