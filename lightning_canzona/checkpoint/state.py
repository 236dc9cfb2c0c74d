"""The state a checkpoint holds: every owner's matrix state in a single file
(`full_optimizer_state`), and in a distributed checkpoint teams' state whole and a stack's failure
count whole (`distributed_optimizer_state`); the model's weights whole (`full_model_state`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_canzona.checkpoint.streaming import CHUNK_BYTES, stream_to_rank_zero
from lightning_canzona.optim import MatrixOptimizer
from lightning_canzona.rules.base import FAILURES


def full_optimizer_state(
    module: nn.Module, optimizer: MatrixOptimizer, chunk_bytes: int = CHUNK_BYTES
) -> dict[str, Any]:
    """The whole optimizer state on rank 0's host, keyed by parameter name (collective).

    Sharded state is gathered by ``get_optimizer_state_dict(full_state_dict=True)``, tensor by
    tensor; the matrix state that lives only on each matrix's owner (or in slices on a team's
    members, whole on its first within `MatrixOptimizer.whole_team_state`) is streamed from the
    owners in chunks of at most ``chunk_bytes`` (`lightning_canzona.checkpoint.streaming`): rank
    0's device holds one chunk at a time, never every owner's state.

    Raises:
        Exception: On every rank, when streaming failed on any rank.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    names = {id(param): name for name, param in module.named_parameters()}
    device = next(module.parameters()).device  # an NCCL process group takes no host tensor
    with optimizer.whole_team_state():
        state_dict = get_optimizer_state_dict(module, optimizer, options=options)
        held = {names[id(param)]: matrix_state for param, matrix_state in optimizer.owner_held_state()}
        everyone = stream_to_rank_zero(held, device, chunk_bytes)
    counts: dict[str, torch.Tensor] = {}
    for owned in everyone:
        for name, matrix_state in owned.items():
            state_dict["state"].setdefault(name, {}).update(matrix_state)
            if FAILURES in matrix_state:  # a stack's matrices' owners each count their own
                counts[name] = counts.get(name, 0) + matrix_state[FAILURES]
    for name, count in counts.items():
        state_dict["state"][name][FAILURES] = count
    return state_dict


def distributed_optimizer_state(module: nn.Module, optimizer: MatrixOptimizer) -> dict[str, Any]:
    """This rank's part of the optimizer state for a distributed checkpoint (collective).

    Each rank's part holds the matrix state of the matrices it owns, a team's whole on its first
    member (loadable at any mesh and plan). A stack's matrices have owners on several ranks,
    each counting its own failed decompositions under the stack's one key, which the checkpoint
    saves once: each owner's part holds the total (as `full_optimizer_state` does), and a load
    leaves it with one owner (`MatrixStateCustody.keep_loaded_stack_failures_on_one_owner`).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=False, cpu_offload=True)
    with optimizer.whole_team_state():
        state_dict = get_optimizer_state_dict(module, optimizer, options=options)
    stacks = {name: param for name, param in module.named_parameters() if param.ndim == 3}
    if stacks:  # the same on every rank: the model's
        # Counted by the owners of record (one HSDP replica's where each replica plans alike).
        owned = {id(param): state for param, state in optimizer.owner_held_state()}
        held = [int(owned.get(id(param), {}).get(FAILURES, 0)) for param in stacks.values()]
        # On the parameters' device: an NCCL process group takes no host tensor.
        counts = torch.tensor(held, dtype=torch.int64, device=next(iter(stacks.values())).device)
        torch.distributed.all_reduce(counts)
        for name, count in zip(stacks, counts.tolist()):
            if FAILURES in state_dict["state"].get(name, {}):
                state_dict["state"][name][FAILURES] = torch.tensor(count, dtype=torch.int64)
    return state_dict


def full_model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's state dict with every tensor whole, on rank 0's CPU (empty elsewhere; collective).

    Each sharded tensor is gathered and moved to the CPU in turn: rank 0 holds one full copy of the
    weights at most, on the host.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
