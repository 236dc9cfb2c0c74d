"""Pre-train the bundled Qwen3-style model with a hand-written Lightning Fabric loop.

    python examples/fabric/pretrain.py                # 4 CPU processes, dp 2 × tp 2 chosen for the model
    python examples/fabric/pretrain.py --steps 200 --checkpoint runs/pretrain/checkpoint

``Fabric(strategy="canzona")`` composes the model's tensor-parallel plan with FSDP2 on the mesh it
chooses, prints the optimizer's plan, and computes every weight matrix's Muon update once, on one
owner. The loop is plain Fabric: accumulation under ``no_backward_sync``, clipping, ``fabric.log``
of the loss and of the optimizer step's costs (`lightning_canzona.StepTelemetry`, in
``runs/pretrain/logs/metrics.csv``), ``fabric.save`` — which keeps the last good checkpoint until
the new one is complete, and loads at any mesh (``--resume``).
"""

from __future__ import annotations

import argparse

import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger
from torch.utils.data import DataLoader

import lightning_canzona as lc
from lightning_canzona.data.text import ByteChunks, load_corpus
from lightning_canzona.models.qwen3 import Qwen3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--checkpoint", default=None, help="save the run here at its end")
    parser.add_argument("--resume", default=None, help="a checkpoint to continue from")
    parser.add_argument("--log-every", type=int, default=10, help="steps between logs of the step's costs")
    parser.add_argument("--out", default="runs/pretrain", help="the run's folder: its logs/")
    args = parser.parse_args()
    logger = CSVLogger(f"{args.out}/logs", name="", version="")
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy="canzona", loggers=logger)
    fabric.launch(pretrain, args)


def pretrain(fabric: Fabric, args: argparse.Namespace) -> None:
    """What every rank runs: the training loop, its logs and the checkpoint."""
    fabric.seed_everything(0, verbose=False)
    model = fabric.setup_module(Qwen3("tiny"))  # the model first: the mesh is chosen for it
    optimizer = fabric.setup_optimizers(
        lc.Muon(lc.matrix_param_groups(model), lr=0.02, adamw_lr=3e-3, weight_decay=0.01)
    )
    loader = fabric.setup_dataloaders(DataLoader(ByteChunks(load_corpus(), 128), batch_size=8, shuffle=True))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume:
        fabric.load(args.resume, state)
    telemetry = lc.StepTelemetry(optimizer)

    batches = iter(loader)
    while state["step"] < args.steps:
        for index in range(args.accumulate):
            tokens = next(batches, None)
            if tokens is None:  # a new epoch
                batches = iter(loader)
                tokens = next(batches)
            with fabric.no_backward_sync(model, enabled=index < args.accumulate - 1):
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
                fabric.backward(loss / args.accumulate)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        telemetry.update()
        state["step"] += 1
        fabric.log("train_loss", loss.item(), step=state["step"])
        if state["step"] % args.log_every == 0:  # every rank: the costs are gathered from all
            fabric.log_dict(telemetry.compute(), step=state["step"])
            fabric.print(f"step {state['step']}: loss {loss.item():.3f}")
    fabric.print(f"trained {state['step']} steps")
    fabric.logger.finalize("success")
    if args.checkpoint:
        fabric.save(args.checkpoint, state)


if __name__ == "__main__":
    main()
