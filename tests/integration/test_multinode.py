"""Jobs of several nodes as torchrun's agents run them on a cluster: here one agent a "node" of 2
CPU ranks, the agents meeting by the c10d rendezvous on this machine."""

from __future__ import annotations

import re
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from elastic_job import STEPS, main
from fabric_loop import check_against_one_process
from printed import warning_lines
from scripts import run_nodes, run_slurm_tasks

import lightning_canzona as lc
from lightning_canzona.elastic import check_restartable, nodes_started

JOB = Path(__file__).with_name("elastic_job.py")
FABRIC_LOOP = Path(__file__).with_name("fabric_loop.py")


def test_a_job_that_loses_a_node_resumes_by_itself_and_goes_on_with_the_nodes_left(tmp_path) -> None:
    """Two nodes of 2 ranks (``--nnodes 1:2 --max-restarts 2``), node 1 lost twice
    (`elastic_job`): its ranks while saving the step-4 checkpoint, then the whole node (its agent
    too) in step 5. The agents restart the job each time; it resumes from ``last`` by itself: from
    step 2 (the torn save left ``last`` as it was) on the same mesh, where its step-4 weights are
    bit for bit those of one uninterrupted node of 4 ranks (whose training equals one process
    within float32's bounds: tests/integration/test_transformers.py); then from step 4 on the node
    left, resharded onto its 2 ranks, where it ends with the weights of the same two steps resumed
    from that checkpoint by one node of 2 ranks."""
    job = tmp_path / "job"
    job.mkdir()
    nodes = run_nodes(
        JOB,
        job,
        2,
        2,
        nodes=2,
        devices=2,
        cwd=job,
        min_nodes=1,
        max_restarts=2,
        rendezvous={"last_call_timeout": 3, "keep_alive_interval": 1, "keep_alive_max_attempt": 2},
        env={"LOSE_A_NODE": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        timeout=240,
    )
    output = "\n".join(printed for _, printed in nodes)
    assert nodes[0][0] == 0 and nodes[1][0] == -signal.SIGKILL, output[-4000:]
    # "auto" keeps tensor parallelism inside a node; on the node left, over its 2 devices.
    assert "data_parallel 2 × tensor_parallel 2: tensor parallelism over each node's 2 devices" in output
    assert "; within each node: tensor_parallel." in output
    assert "data_parallel 1 × tensor_parallel 2" in output
    assert "the launcher started 2 ranks, 1 node(s) of 2, not num_nodes=2" in output
    assert output.count("killed while saving the step-4 checkpoint") == 2  # both ranks of node 1
    assert "node 1 lost in step 5, its agent with it" in output
    starts = sorted(int(step) for step in re.findall(r"rank \d starts at step (\d+)", output))
    assert starts == [0] * 4 + [2] * 4 + [4] * 2, output[-4000:]
    assert output.count(f"ended at step {STEPS}") == 2

    uninterrupted = tmp_path / "uninterrupted"
    main(uninterrupted, 1, 4, ckpt_path=None, checkpoints=False, tensor_parallel_size=2, start_method="fork")
    resharded = tmp_path / "resharded"
    checkpoint = job / "checkpoints" / "epoch=0-step=4.ckpt"
    main(resharded, 1, 2, ckpt_path=str(checkpoint), checkpoints=False, start_method="fork")
    for step, reference in ((2, uninterrupted), (4, uninterrupted), (STEPS, resharded)):
        got, expected = (torch.load(folder / f"weights-{step}.pt") for folder in (job, reference))
        assert got.keys() == expected.keys()
        for name, weight in expected.items():
            assert torch.equal(got[name], weight), (step, name)


def test_a_fabric_loop_on_two_nodes_with_a_replica_each_trains_as_one_process(tmp_path) -> None:
    """``CanzonaFabricStrategy(data_parallel_replicate_size="auto")`` with ``num_nodes=2,
    devices=2``, its 4 ranks started as ``srun`` starts a SLURM job's tasks on 2 nodes
    (Lightning's ``SLURMEnvironment``), and by two torchrun agents (the Trainer's torchrun job is
    above): the tiny model fits a node, so a replica (HSDP) and tensor parallelism within each
    node, so that only the gradients' all-reduce and the optimizer's exchange cross them, and the
    weights of the same loop in one process. The two jobs run at once (each imports Lightning on
    one core first)."""

    def launch(launcher: str) -> tuple[int, str, Path]:
        folder = tmp_path / launcher
        folder.mkdir()
        arguments = (FABRIC_LOOP, folder / "trained.pt", 2, 2, "auto")
        if launcher == "slurm":
            return *run_slurm_tasks(*arguments, nodes=2, devices=2, cwd=folder), folder
        nodes = run_nodes(*arguments, nodes=2, devices=2, cwd=folder)
        return max(abs(code) for code, _ in nodes), "\n".join(printed for _, printed in nodes), folder

    with ThreadPoolExecutor(2) as jobs:
        launched = list(jobs.map(launch, ["slurm", "torchrun"]))
    for code, output, folder in launched:
        assert code == 0, (folder.name, output[-4000:])
        assert "device mesh data_parallel 2 (replicate 2 × shard 1) × tensor_parallel 2" in output
        assert "data_parallel_replicate_size 'auto': 2, a replica a node (the model's" in output
        assert (
            "Across nodes: HSDP's all-reduces of gradients (data_parallel_replicate), the optimizer's"
            in output
        )
        assert "; within each node: tensor_parallel." in output
        assert not warning_lines(output), output[-3000:]  # no slice of the flattened data_parallel
        trained = torch.load(folder / "trained.pt")
        assert trained["meshes"] == [(2, 1, 2)]
        check_against_one_process(trained, tensor_parallel=True)


ELASTIC = {
    "TORCHELASTIC_RUN_ID": "job",
    "TORCHELASTIC_MAX_RESTARTS": "3",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}


@pytest.mark.parametrize("fabric", [False, True], ids=["trainer", "fabric"])
def test_restarts_that_torchruns_shared_store_would_hang_are_refused_on_every_rank(
    monkeypatch, fabric
) -> None:
    environment = {**ELASTIC, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    environment |= {"GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    import lightning as L

    with pytest.raises(RuntimeError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1") as raised:
        if fabric:
            L.Fabric(strategy=lc.CanzonaFabricStrategy(), accelerator="cpu", devices=2, num_nodes=2)
        else:
            L.Trainer(strategy="canzona", accelerator="cpu", devices=2, num_nodes=2)
    assert "torchrun --max-restarts 3 cannot restart this job" in str(raised.value)
    check_restartable({**ELASTIC, "TORCHELASTIC_USE_AGENT_STORE": "False"})  # the fix
    check_restartable({**ELASTIC, "TORCHELASTIC_MAX_RESTARTS": "0"})  # no restarts asked for
    check_restartable({})  # not under torchrun


def test_a_launch_that_is_not_whole_nodes_is_refused_and_fewer_nodes_are_followed(recwarn) -> None:
    with pytest.raises(
        ValueError, match="The launcher started 5 ranks, which is not a number of nodes of devices=2"
    ):
        nodes_started(5, 2, 2)
    assert nodes_started(4, 2, 2) == 2 and not recwarn.list
    assert nodes_started(2, 2, 2) == 1  # an elastic restart on the node left
    assert "the launcher started 2 ranks, 1 node(s) of 2, not num_nodes=2" in str(recwarn.pop().message)
