"""Projected end-to-end training iteration: forward + backward, FSDP traffic, optimizer step.

Assumptions (each a field of `Workload`, so a report can state them):

- **Forward + backward** costs ``6 · params · tokens`` FLOPs (Kaplan et al., 2020), spread evenly
  over the ``dp·tp`` GPUs, at ``mfu`` of the device's dense BF16 peak. Tensor-parallel activation
  collectives are not modelled separately: they are part of what keeps MFU below 1.
- **FSDP2** all-gathers the parameters twice (forward, and again in backward because blocks
  reshard after forward) and reduce-scatters the gradients once, among the ``dp`` ranks that share
  a TP slice, in ``param_bytes`` per element. A fraction ``fsdp_overlap`` of that time hides behind
  compute (prefetching), and never more than the compute itself.
- **Elementwise optimizer work** (momentum, AdamW, the parameter update of every shard) moves
  ``elementwise_bytes`` of HBM traffic per parameter element a rank holds.
- The **matrix-rule step** is `optimizer_step.project_step`'s pipelined time; it does not overlap
  the next forward.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_canzona.planning.devices import DeviceModel
from lightning_canzona.tools.simulation.optimizer_step import StepProjection


@dataclass(frozen=True)
class Workload:
    """The training job around the optimizer.

    Attributes:
        global_batch: Sequences per iteration over the whole mesh (default 1024: with 4096-token
            sequences, a 4M-token batch, common in LLM pre-training).
        seq_len: Tokens per sequence.
        mfu: Achieved fraction of BF16 peak in forward and backward (0.4 is typical of well-tuned
            FSDP + TP training at this scale).
        param_bytes: Bytes per element in FSDP's collectives (2: BF16 parameters and gradients).
        fsdp_overlap: Fraction of FSDP communication hidden behind compute.
        elementwise_bytes: HBM bytes per parameter element of the elementwise optimizer work
            (read gradient; read/write parameter and one or two moments in float32).
    """

    global_batch: int = 1024
    seq_len: int = 4096
    mfu: float = 0.4
    param_bytes: int = 2
    fsdp_overlap: float = 0.8
    elementwise_bytes: float = 24.0

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.seq_len < 1:
            raise ValueError("global_batch and seq_len must be >= 1")
        if not 0.0 < self.mfu <= 1.0:
            raise ValueError(f"mfu must lie in (0, 1], got {self.mfu}")
        if not 0.0 <= self.fsdp_overlap <= 1.0:
            raise ValueError(f"fsdp_overlap must lie in [0, 1], got {self.fsdp_overlap}")

    @property
    def tokens(self) -> int:
        """Tokens per iteration over the whole mesh."""
        return self.global_batch * self.seq_len


@dataclass(frozen=True)
class IterationProjection:
    """Projected seconds of one training iteration, by part.

    Attributes:
        forward_backward: Forward and backward compute.
        fsdp_exposed: FSDP communication not hidden behind compute.
        elementwise: Elementwise optimizer work.
        optimizer_step: The matrix-rule step (pipelined).
    """

    forward_backward: float
    fsdp_exposed: float
    elementwise: float
    optimizer_step: float

    @property
    def total(self) -> float:
        return self.forward_backward + self.fsdp_exposed + self.elementwise + self.optimizer_step


def project_iteration(
    step: StepProjection, num_params: int, dp: int, tp: int, device: DeviceModel, workload: Workload
) -> IterationProjection:
    """Project one iteration around the optimizer step ``step``.

    Args:
        step: The projected matrix-rule step.
        num_params: Parameters of the whole model (matrices, embeddings, norms).
        dp: Data-parallel size.
        tp: Tensor-parallel size (kept inside a node when it fits).
        device: GPU and links.
        workload: Batch and efficiency assumptions.

    Returns:
        The iteration's parts.
    """
    num_ranks = dp * tp
    forward_backward = 6 * num_params * workload.tokens / num_ranks / (device.bf16_flops * workload.mfu)
    fsdp = 0.0
    if dp > 1:
        # TP ranks fill a node first, so the DP group crosses nodes whenever the mesh does.
        _, bandwidth, latency = device.link(num_ranks)
        shard_volume = (dp - 1) / dp * num_params / tp * workload.param_bytes
        fsdp = 3 * (shard_volume / bandwidth + (dp - 1) * latency)
    fsdp_exposed = max(fsdp * (1.0 - workload.fsdp_overlap), fsdp - forward_backward)
    elementwise = num_params / num_ranks * workload.elementwise_bytes / device.hbm_bandwidth
    return IterationProjection(forward_backward, fsdp_exposed, elementwise, step.pipelined)
