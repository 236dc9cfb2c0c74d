"""After ``fit`` with the in-process launchers, the launching process's model holds the trained weights:
the ranks' own final weights, bit for bit, and the one-process fine-tune's to float32 noise."""

from __future__ import annotations

import functools

import pytest
import torch
from lightning import Callback
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

import lightning_canzona as lc
from lightning_canzona.models import CausalLanguageModel

# One step: tensor parallelism sums in another order than one process, and further steps amplify
# that float32 noise (measured 2-4e-5 of the update after 3 steps, 7.8e-6 after one).
STEPS, BATCH, SEQ = 1, 4, 32
# adamw_eps 1e-3: AdamW's first step g/(|g| + ε) is ±lr wherever |g| ≫ ε, and where |g| is near ε
# float32 noise moves it by up to lr (one lm_head element of 32,768 did, with ε = 1e-8).
OPTIMIZER = functools.partial(lc.Muon, lr=0.02, adamw_lr=3e-3, adamw_eps=1e-3, compute_dtype="float32")


def _batches() -> torch.Tensor:
    return torch.randint(256, (STEPS * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(2))


class FineTune(CausalLanguageModel):
    """The tiny model with a constant learning rate."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return OPTIMIZER(lc.matrix_param_groups(self.model))


def _one_process(initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same fine-tune on the full model in this process."""
    module = FineTune("tiny")
    module.load_state_dict(initial)
    optimizer = module.configure_optimizers()
    for batch in DataLoader(_batches(), batch_size=BATCH):
        optimizer.zero_grad()
        module._loss(batch).backward()  # training_step without its logging
        optimizer.step()
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


class SaveFinalWeights(Callback):
    """The ranks' final weights, each parameter gathered whole by DTensor, saved by rank 0."""

    def __init__(self, path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        whole = {
            n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in pl_module.state_dict().items()
        }
        if trainer.global_rank == 0:
            torch.save({n: t.detach().clone() for n, t in whole.items()}, self.path)


# Spawn on 2 ranks (tp 2): each spawned rank imports torch and Lightning anew (38 s for 4 here).
@pytest.mark.parametrize("start_method, mesh", [("fork", (2, 2)), ("spawn", (1, 2))], ids=["fork", "spawn"])
def test_the_trained_weights_come_back_to_the_launching_process(
    tmp_path, capfd, start_method, mesh, quiet_trainer, one_thread
) -> None:
    torch.manual_seed(0)
    module = FineTune("tiny")
    initial = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    trainer = quiet_trainer(
        strategy=lc.CanzonaStrategy(
            data_parallel_size=mesh[0], tensor_parallel_size=mesh[1], start_method=start_method
        ),
        devices=mesh[0] * mesh[1],
        max_steps=STEPS,
        use_distributed_sampler=False,  # every rank the same batches: the one process's
        callbacks=[SaveFinalWeights(tmp_path / "ranks.pt")],
    )
    trainer.fit(module, DataLoader(_batches(), batch_size=BATCH))
    assert "While redistributing" not in capfd.readouterr().err  # DTensor's note on the gathers
    on_the_ranks = torch.load(tmp_path / "ranks.pt")
    expected = _one_process(initial)
    came_back = module.state_dict()
    assert came_back.keys() == expected.keys() == on_the_ranks.keys()
    for name, weight in came_back.items():
        assert not isinstance(weight, DTensor) and torch.equal(weight, on_the_ranks[name]), name
        update, expected_update = weight - initial[name], expected[name] - initial[name]
        assert expected_update.norm() > 0, name
        # Tensor parallelism sums in another order than one process: float32 noise; and an update
        # is the difference of two float32 weights, known to their last bit only (norms near 1).
        bound = 1e-5 * expected_update.norm() + torch.finfo(torch.float32).eps * initial[name].norm()
        assert (update - expected_update).norm() <= bound, name
