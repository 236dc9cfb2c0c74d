"""The elementwise maximum over all ranks, in the fewest rounds of messages the backend allows.

Every step agrees twice on small tensors of flags (`gradients`, `failures`): a maximum, which
the order of its operands cannot change. NCCL's all-reduce of a few hundred bytes is one
latency-bound round. gloo's is a ring: ``2·(w − 1)`` rounds, each a hand-off between processes,
which on CPU ranks that share cores waits for the scheduler every time. There one all-to-all,
in which every rank sends its tensor to every other and takes the maximum of what it receives,
is one round (for CPU tensors; a CUDA tensor on gloo keeps the all-reduce): measured here (four
gloo ranks on two cores, 188 flags, 300 calls), 2.4 ms per call and 0.85 ms of CPU per rank,
against 5.5 ms and 1.95 ms for the all-reduce.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from lightning_canzona.distributed.inflight import wait_for


def agree_on_maximum(tensor: Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Replace ``tensor``, in place, by its elementwise maximum over ``group``'s ranks (collective,
    blocking; every rank gets the same values)."""
    world = dist.get_world_size(group)
    if dist.get_backend(group) != "gloo" or tensor.device.type != "cpu" or world == 1:
        wait_for(dist.all_reduce, tensor, op=dist.ReduceOp.MAX, group=group)
        return
    flat = tensor.reshape(-1)
    received = flat.new_empty(world * flat.numel())
    wait_for(dist.all_to_all_single, received, flat.repeat(world), group=group)
    tensor.copy_(received.view(world, -1).amax(dim=0).view_as(tensor))
