"""Jobs that torchrun (or SLURM) starts: the nodes it started, and restarts that work.

An elastic job (``torchrun --nnodes 1:4``) may be restarted on fewer nodes than the script's
``num_nodes`` says: the mesh is chosen for the ranks the launcher started (`nodes_started`).

torchrun's agents restart every rank of the job when one fails (a node lost), and the job resumes
from its last checkpoint (``Trainer.fit(ckpt_path="last")``). Since torch 2.5, the c10d and
static rendezvous share the agents' TCPStore with the ranks (``TORCHELASTIC_USE_AGENT_STORE``),
and that store outlives a restart with every key the previous attempt wrote in it: the restarted
ranks read the dead ranks' addresses (gloo) or unique ids (NCCL) and fail or wait in
``init_process_group`` until its timeout — 30 minutes on gloo; found here as a job whose restart
hung for 8 minutes, one rank past ``init_process_group`` and three inside it
(pytorch/pytorch#135712, whose per-attempt prefix was dropped for a per-round store that 2.13's
agent does not create). With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment
the c10d rendezvous gives the ranks a store of their own, at a fresh port each attempt, and
restarts work (``tests/integration/test_multinode.py``); the static rendezvous
(``--master-addr``/``--master-port``) shares its store whatever the variable says.

Pure: reads the environment torchrun gives its ranks, so that every rank takes the same decision
before any process group starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_warn

#: What torchrun's agent needs in its own environment for restarts that work.
FIX = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


def check_restartable(environ: Mapping[str, str] = os.environ) -> None:
    """Raise if torchrun was asked for restarts and shares its store with the ranks.

    Args:
        environ: The rank's environment (torchrun's ``TORCHELASTIC_*`` variables).

    Raises:
        RuntimeError: ``--max-restarts`` above 0 with the agents' store shared with the ranks,
            naming the variable that fixes it.
    """
    restarts = int(environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    if restarts > 0 and environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        raise RuntimeError(
            f"torchrun --max-restarts {restarts} cannot restart this job: its agents share their "
            "store with the ranks, and a restarted rank would read the addresses of the ranks that "
            "died from it and wait in init_process_group until its timeout (pytorch/pytorch#135712). "
            f"Launch torchrun with the c10d rendezvous (--rdzv-backend c10d --rdzv-endpoint HOST:PORT, "
            f"or --standalone on one node) and {FIX} in its environment (`{FIX} torchrun …`, or "
            f"`export {FIX}` in the batch script): the ranks then meet on a store of their own for "
            "each attempt. (The static rendezvous, --master-addr/--master-port, always shares it.)"
        )


def nodes_started(world_size: int, devices_per_node: int, num_nodes: int) -> int:
    """The nodes of a job whose launcher started ``world_size`` ranks, ``devices_per_node`` a node.

    Args:
        world_size: Ranks the launcher started (torchrun's ``WORLD_SIZE``).
        devices_per_node: The Trainer's or Fabric's ``devices``.
        num_nodes: Their ``num_nodes``; a warning (once, rank 0) where the launcher started
            another number: after an elastic restart on the nodes left, or a script that says
            other than its launch.

    Raises:
        ValueError: ``world_size`` is not a multiple of ``devices_per_node``.
    """
    nodes, left = divmod(world_size, devices_per_node)
    if left or not nodes:
        raise ValueError(
            f"The launcher started {world_size} ranks, which is not a number of nodes of devices="
            f"{devices_per_node}: set devices to the ranks it starts per node (torchrun's --nproc-per-node)."
        )
    if nodes != num_nodes:
        rank_zero_warn(
            f"lightning_canzona: the launcher started {world_size} ranks, {nodes} node(s) of "
            f"{devices_per_node}, not num_nodes={num_nodes}: the mesh is chosen for the ranks it "
            "started (an elastic job restarted on the nodes left, or num_nodes other than the launch's)."
        )
    return nodes


def nodes_of_launch(environment: ClusterEnvironment, devices_per_node: int, num_nodes: int) -> int:
    """What a strategy asks of a job that torchrun or SLURM started: restarts that work
    (`check_restartable`), and the nodes the launcher started (`nodes_started`)."""
    check_restartable()
    return nodes_started(environment.world_size(), devices_per_node, num_nodes)
