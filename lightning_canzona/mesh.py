"""The device mesh's shape: how many devices go to data parallelism and how many to tensor
parallelism, ``"auto"`` included.

Lightning's ``ModelParallelStrategy`` reads ``"auto"`` as tensor parallelism over every device of
a node, whatever the model: a model with 2 key/value heads then fails in its first forward on 4
devices. Here ``"auto"`` reads the model (`lightning_canzona.composition.tensor_parallel_constraints`)
and picks the largest tensor-parallel size that divides the devices per node and every size that
tensor parallelism splits; an explicit size is kept exactly as given, and checked.

Pure: reads the module's declarations, never a process group, so the launching process chooses
before any rank starts and every rank chooses the same.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from torch import nn

from lightning_canzona.composition import (
    check_composable,
    check_tensor_parallel_size,
    dividing_sizes,
    has_tensor_parallel_plan,
    tensor_parallel_constraints,
)

Size = Literal["auto"] | int


#: The collectives of each mesh dimension, for `MeshShape.crossing`.
_COLLECTIVES = {
    "data_parallel_replicate": "HSDP's all-reduces of gradients (data_parallel_replicate)",
    "data_parallel": "FSDP2's all-gathers and reduce-scatters (data_parallel)",
    "data_parallel_shard": "FSDP2's all-gathers and reduce-scatters (data_parallel_shard)",
    "tensor_parallel": "every layer's tensor-parallel collectives (tensor_parallel)",
}


@dataclass(frozen=True)
class MeshShape:
    """A ``(data_parallel, tensor_parallel)`` mesh and why it has that shape.

    Attributes:
        data_parallel_size: Devices per data-parallel group.
        tensor_parallel_size: Devices per tensor-parallel group.
        reason: Why, in a user's words (what ``"auto"`` read, or that the sizes were given).
        devices_per_node: Devices (ranks) on each node; ``None``: one node.
        replicate_size: Replicas among the data-parallel devices (HSDP): FSDP2 shards over
            ``data_parallel_size // replicate_size`` of them and all-reduces gradients across
            the replicas; 1: FSDP2 shards over all of them.
    """

    data_parallel_size: int
    tensor_parallel_size: int
    reason: str
    devices_per_node: int | None = None
    replicate_size: int = 1

    @property
    def shard_size(self) -> int:
        """Devices each replica's FSDP2 shards over."""
        return self.data_parallel_size // self.replicate_size

    def dimensions(self) -> dict[str, int]:
        """The device mesh's dimensions, outermost first: HSDP's two data-parallel ones where
        there are replicas (Lightning's ``data_parallel`` is then the two flattened)."""
        if self.replicate_size == 1:
            return {"data_parallel": self.data_parallel_size, "tensor_parallel": self.tensor_parallel_size}
        return {
            "data_parallel_replicate": self.replicate_size,
            "data_parallel_shard": self.shard_size,
            "tensor_parallel": self.tensor_parallel_size,
        }

    def describe(self) -> str:
        """One line for the log; on several nodes, which collectives cross them."""
        data_parallel = f"data_parallel {self.data_parallel_size}"
        if self.replicate_size > 1:
            data_parallel += f" (replicate {self.replicate_size} × shard {self.shard_size})"
        line = (
            f"lightning_canzona: device mesh {data_parallel} × tensor_parallel "
            f"{self.tensor_parallel_size}: {self.reason}."
        )
        crossing = self.crossing()
        return f"{line} {crossing}" if crossing else line

    def crossing(self) -> str:
        """Which of the mesh's collectives go between nodes (``""`` on one node).

        The ranks fill the mesh's `dimensions` innermost first (tensor parallelism), node after
        node: a dimension's groups stay within a node where the ranks they span (its size times
        the sizes inside it) divide the devices per node. The optimizer's exchange spans the
        whole mesh, or under HSDP each replica where its plan is replicated
        (`lightning_canzona.planning.replication`).
        """
        per_node = self.devices_per_node
        if per_node is None or self.data_parallel_size * self.tensor_parallel_size <= per_node:
            return ""
        across, within, span = [], [], 1
        for name, size in reversed(self.dimensions().items()):
            span *= size
            if size > 1:
                (within if per_node % span == 0 else across).insert(0, name)
        optimizer = "the optimizer's gathers and scatters"
        if self.replicate_size > 1 and per_node % (self.shard_size * self.tensor_parallel_size) == 0:
            optimizer += " where its plan spreads over the replicas (the plan report says)"
        crossing = [_COLLECTIVES[name] for name in across] + [optimizer]
        line = "Across nodes: " + ", ".join(crossing)
        if within:
            line += "; within each node: " + ", ".join(within)
        if "tensor_parallel" in across:
            line += (
                f" (a tensor_parallel_size that divides the {per_node} devices per node keeps them in one)"
            )
        return line + "."


def choose_mesh(
    module: nn.Module | None,
    data_parallel_size: Size,
    tensor_parallel_size: Size,
    num_nodes: int,
    devices_per_node: int,
    composes: bool = True,
    replicate_size: Size = 1,
) -> MeshShape:
    """The mesh for ``module`` on ``num_nodes × devices_per_node`` devices.

    Args:
        module: The model (``None``: nothing to read; an ``"auto"`` size follows Lightning's).
        data_parallel_size: As given to the strategy: an integer, kept, or ``"auto"``.
        tensor_parallel_size: As given to the strategy: an integer, kept, or ``"auto"``.
        num_nodes: Nodes of the job.
        devices_per_node: Devices (processes) per node.
        composes: Whether the strategy composes the module (``False``: its ``configure_model``
            parallelizes it, with whatever sizes the mesh has).
        replicate_size: Replicas among the data-parallel devices (HSDP; `MeshShape`), or
            ``"auto"``: decided on the ranks, where the devices' memory is known
            (`auto_replicas`); 1 until then.

    Raises:
        ValueError: A size that does not divide the devices, sizes whose product is not the
            number of devices, a replicate size that does not divide the data-parallel one, or a
            tensor-parallel size that the module cannot take
            (`lightning_canzona.composition.check_composable`), naming the setting.
    """
    world = num_nodes * devices_per_node
    devices = f"the {world} devices ({num_nodes} node(s) × {devices_per_node})"
    for name, size in (
        ("data_parallel_size", data_parallel_size),
        ("tensor_parallel_size", tensor_parallel_size),
    ):
        if size != "auto" and (
            isinstance(size, bool) or not isinstance(size, int) or size < 1 or world % size
        ):
            raise ValueError(
                f"{name}={size!r} does not divide {devices}; choose a divisor of {world}, or 'auto'."
            )
    if tensor_parallel_size != "auto":
        tp = tensor_parallel_size
        if data_parallel_size != "auto" and data_parallel_size * tp != world:
            raise ValueError(
                f"data_parallel_size={data_parallel_size} × tensor_parallel_size={tp} is not {devices}; "
                "set one of them to 'auto'."
            )
        shape = MeshShape(
            world // tp, tp, "as given" if data_parallel_size != "auto" else "tensor_parallel_size as given"
        )
    elif data_parallel_size != "auto":
        shape = MeshShape(data_parallel_size, world // data_parallel_size, "data_parallel_size as given")
    else:
        shape = _auto(module, num_nodes, devices_per_node, composes)
    if replicate_size == "auto":
        replicate_size = 1
    elif isinstance(replicate_size, bool) or not isinstance(replicate_size, int) or replicate_size < 1:
        raise ValueError(
            f"data_parallel_replicate_size must be a positive integer or 'auto', got {replicate_size!r}"
        )
    # Without the model, "auto" sizes are not known yet (the launching process chooses them with
    # it): only the devices bound the replicas then.
    unknown = module is None and data_parallel_size == tensor_parallel_size == "auto"
    if unknown and world % replicate_size:
        raise ValueError(f"data_parallel_replicate_size={replicate_size} does not divide {devices}.")
    if not unknown and shape.data_parallel_size % replicate_size:
        raise ValueError(
            f"data_parallel_replicate_size={replicate_size} does not divide the data-parallel size "
            f"{shape.data_parallel_size} ({shape.reason}): each replica shards over as many devices."
        )
    shape = replace(
        shape, devices_per_node=devices_per_node if num_nodes > 1 else None, replicate_size=replicate_size
    )
    if module is not None:
        if composes:
            check_composable(module, shape.tensor_parallel_size)
        else:
            check_tensor_parallel_size(module, shape.tensor_parallel_size)
    return shape


def _auto(module: nn.Module | None, num_nodes: int, devices_per_node: int, composes: bool) -> MeshShape:
    """Both sizes ``"auto"``: tensor parallelism within a node, as large as the model allows."""
    world = num_nodes * devices_per_node
    if module is not None and composes and not has_tensor_parallel_plan(module):
        name = type(module).__name__
        return MeshShape(world, 1, f"{name} declares no tensor-parallel plan, so FSDP2 over every device")
    constraints = tensor_parallel_constraints(module) if module is not None else {}
    if not constraints:
        # A module that parallelizes itself and says nothing of its sizes: Lightning's convention.
        return MeshShape(
            num_nodes, devices_per_node, "tensor parallelism over each node's devices (Lightning's 'auto')"
        )
    tp = dividing_sizes(constraints.values(), devices_per_node)[-1]
    if tp == devices_per_node:
        reason = f"tensor parallelism over each node's {devices_per_node} devices"
    else:
        # The next larger size that a node's devices allow, and the first size it does not divide.
        larger = next(d for d in range(tp + 1, devices_per_node + 1) if devices_per_node % d == 0)
        name, size = next((n, s) for n, s in constraints.items() if s % larger)
        limit = f"tensor_parallel_size {larger} would not divide {name}={size}"
        reason = (
            f"{limit}, so FSDP2 over every device"
            if tp == 1
            else f"the largest size that divides {devices_per_node} devices per node and every size the plan "
            f"splits ({limit})"
        )
    return MeshShape(world // tp, tp, reason)


#: What ``data_parallel_replicate_size="auto"`` counts a parameter at, in bytes: float32 weights
#: and gradients, and two float32 moments of optimizer state (AdamW's; Muon holds one).
BYTES_PER_PARAMETER = 16


def auto_replicas(shape: MeshShape, num_nodes: int, parameters: int, node_memory: int) -> MeshShape:
    """``shape`` with ``data_parallel_replicate_size="auto"`` decided: a replica a node (HSDP:
    FSDP2's all-gathers and reduce-scatters stay within a node, only the gradients' all-reduce
    crosses) where one node holds the model: its ``parameters`` at `BYTES_PER_PARAMETER` in at
    most half of a node's ``node_memory`` bytes (the other half for activations and the
    optimizer's buffers); else one (FSDP2 over every device), and the reason says why.

    Args:
        shape: The mesh as chosen with one replica.
        num_nodes: Nodes of the job.
        parameters: The model's parameter count (0: not built yet, as by a ``configure_model``).
        node_memory: Bytes of memory on one node's devices together.
    """
    if num_nodes == 1:
        return shape
    needed, memory = _gigabytes(parameters * BYTES_PER_PARAMETER), _gigabytes(node_memory)
    if shape.data_parallel_size % num_nodes:
        why = "1 (tensor parallelism spans nodes)"
    elif not parameters:
        why = "1 (the model has no parameters yet: give the size where configure_model builds them)"
    elif parameters * BYTES_PER_PARAMETER > node_memory // 2:
        why = f"1 (the model's {needed} would take over half of a node's {memory})"
    else:
        why = f"{num_nodes}, a replica a node (the model's {needed} fit in half of a node's {memory})"
        shape = replace(shape, replicate_size=num_nodes)
    return replace(shape, reason=f"{shape.reason}; data_parallel_replicate_size 'auto': {why}")


def _gigabytes(size: int) -> str:
    return f"{size / 1e9:.3g} GB"
