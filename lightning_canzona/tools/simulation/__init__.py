"""Pure performance projections (no torch.distributed): optimizer step and training iteration
times of a plan on a modelled GPU cluster."""

from lightning_canzona.planning.devices import DEVICES, H100, H200, DeviceModel
from lightning_canzona.planning.plan import pipelined_time, sequential_time
from lightning_canzona.tools.simulation.iteration import IterationProjection, Workload, project_iteration
from lightning_canzona.tools.simulation.optimizer_step import StepProjection, project_step

__all__ = [
    "DEVICES",
    "H100",
    "H200",
    "DeviceModel",
    "IterationProjection",
    "StepProjection",
    "Workload",
    "pipelined_time",
    "project_iteration",
    "project_step",
    "sequential_time",
]
