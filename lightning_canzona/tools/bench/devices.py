"""Where a benchmark's ranks run: CPU processes over gloo, or one GPU a rank over NCCL; `check_devices`
refuses, before any rank starts, what the machine cannot run."""

from __future__ import annotations

import torch

from lightning_canzona.tools.checks import gpu_shortage


def rank_device(device: str, rank: int) -> torch.device:
    """The device of rank ``rank`` on ``device`` (``cpu``, or ``cuda``: one GPU a rank)."""
    return torch.device("cuda", rank) if device == "cuda" else torch.device(device)


def check_devices(device: str, backend: str, ranks: int) -> str | None:
    """What is wrong with running ``ranks`` ranks on ``device`` over ``backend``, or ``None``."""
    if device not in ("cpu", "cuda"):
        return f"--device must be cpu or cuda, got {device!r}"
    if backend == "nccl" and device != "cuda":
        return "--backend nccl needs --device cuda (NCCL takes GPU tensors only)"
    shortage = gpu_shortage(ranks) if device == "cuda" else None
    if shortage:
        return f"--device cuda {shortage}: lower --dp or --tp, or set CUDA_VISIBLE_DEVICES"
    return None


def default_backend(device: str) -> str:
    """The process group's backend for ``device`` when none is given: NCCL on GPUs, gloo on CPUs."""
    return "nccl" if device == "cuda" else "gloo"


def start_method(device: str) -> str:
    """How the ranks start: forked on CPUs (no interpreter and imports per rank), spawned on GPUs
    (a forked child cannot use CUDA that its parent used)."""
    return "fork" if device == "cpu" else "spawn"


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work, so that the host's clock measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
