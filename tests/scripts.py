"""Run a user's script as a user would, and never leave a process of it behind."""

from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

#: This folder.
_TESTS = str(Path(__file__).parent)


def run_script(
    *arguments: object, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Run ``python arguments…`` (a script and its arguments, or ``-m`` and a module) in a process
    session of its own; return its exit code and everything it printed. The session (the ranks it
    started included) is killed at the end, whatever happened: on a timeout, the test fails with
    what was printed so far."""
    process = subprocess.Popen(
        [sys.executable, *map(str, arguments)],
        cwd=cwd,
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"python {arguments} ran past {timeout} s:\n{output[-3000:]}") from None
    finally:
        end_session(process)
    return process.returncode, output


#: The entry of `run_examples_forked`'s results that says what importing the package loaded.
IMPORTED = "import lightning_canzona"
#: Runs each ``[folder, [script, arguments…]]`` of the JSON list ``sys.argv[1]`` in turn, in that
#: folder, every `CanzonaStrategy` and ``strategy="canzona"`` it builds forking its ranks
#: from this one interpreter; prints `_BEGIN` before each run's output and `_END` with its exit
#: code after it. First, `_LOADED` and every module loaded once the package is imported.
_BEGIN, _END, _LOADED = "=== example begins: ", "=== example exit code: ", "=== loaded: "
_FORKED = f"""
import functools, json, os, runpy, sys, traceback
import lightning_canzona as lc
print({_LOADED!r} + " ".join(sorted(sys.modules)), flush=True)
from lightning.fabric.strategies import STRATEGY_REGISTRY
from lightning.pytorch.strategies import StrategyRegistry
lc.CanzonaStrategy = functools.partial(lc.CanzonaStrategy, start_method="fork")
for registry in (StrategyRegistry, STRATEGY_REGISTRY):
    registry["canzona"] = registry["canzona_notebook"]
for folder, sys.argv in json.loads(sys.argv[1]):
    os.chdir(folder)
    print({_BEGIN!r} + sys.argv[0], flush=True)
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as exit:
        code = 0 if exit.code is None else exit.code if isinstance(exit.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    print({_END!r} + str(code), flush=True)
"""


def run_examples_forked(runs: dict[str, tuple[Path, Path, list[object]]]) -> dict[str, tuple[int, str]]:
    """The exit code and output of each example in ``runs`` (by name: the script, the folder it
    runs in, its arguments), all run one after the other in one interpreter, each `CanzonaStrategy`
    or ``strategy="canzona"`` forking its ranks instead of re-running the script once each: the
    examples' own code, without an interpreter and its imports per rank and per example (the
    launch that re-runs a script per rank is tested by the main job's test and the failure
    reports'). An example that fails leaves the others to run. Under `IMPORTED`: what ``import
    lightning_canzona`` loaded in that interpreter, module names separated by spaces."""
    listed = [[str(folder), [str(script), *map(str, args)]] for script, folder, args in runs.values()]
    code, output = run_script("-c", _FORKED, json.dumps(listed), cwd=Path.cwd(), timeout=600)
    assert code == 0, output[-3000:]
    header, *parts = output.split(_BEGIN)
    results = {IMPORTED: (0, header.split(_LOADED, 1)[1].split("\n", 1)[0])}
    for name, part in zip(runs, parts, strict=True):
        printed, _, exit_code = part.split("\n", 1)[1].rpartition(_END)  # after the script's name
        results[name] = (int(exit_code.split()[0]), printed)
    return results


#: One node's torchrun agent (``sys.argv[1]``: JSON of its `LaunchConfig`'s settings, the script and
#: its arguments): torchrun's own, `elastic_launch`, whose ranks are forked from a server that
#: imported Lightning once (``forkserver``) instead of each re-running an interpreter and its imports.
_AGENT = """
import json, multiprocessing, sys
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
import scripts
settings, script, arguments = json.loads(sys.argv[1])
multiprocessing.set_forkserver_preload(["lightning", "lightning_canzona"])
elastic_launch(LaunchConfig(**settings, start_method="forkserver"), scripts.run_as_main)(script, arguments)
"""


def run_as_main(script: str, arguments: list[str], env: dict[str, str] | None = None) -> None:
    """Run ``script`` as ``python script arguments…`` would, in this process, ``env`` added to
    its environment."""
    os.environ.update(env or {})
    sys.argv = [script, *arguments]
    runpy.run_path(script, run_name="__main__")


#: `run_slurm_tasks`' ``srun`` (``sys.argv[1]``: JSON of each task's SLURM variables, the script and
#: its arguments): the tasks forked from a server that imported Lightning once.
_SRUN = """
import json, multiprocessing, sys
import scripts
tasks, script, arguments = json.loads(sys.argv[1])
multiprocessing.set_forkserver_preload(["lightning", "lightning_canzona"])
context = multiprocessing.get_context("forkserver")
processes = [context.Process(target=scripts.run_as_main, args=(script, arguments, env)) for env in tasks]
for process in processes:
    process.start()
for process in processes:
    process.join()
sys.exit(max(abs(process.exitcode) for process in processes))
"""


def run_slurm_tasks(script: Path, *arguments: object, nodes: int, devices: int, cwd: Path) -> tuple[int, str]:
    """Run ``script arguments…`` as ``srun`` runs a SLURM job's tasks, ``devices`` a node on
    ``nodes`` nodes, each with the variables SLURM gives it (all on this machine, as node
    ``localhost``); returns the exit code (the largest of the tasks') and everything they printed."""
    job = {"SLURM_JOB_ID": 1, "SLURM_JOB_NAME": "train", "SLURM_NODELIST": "localhost", "SLURM_NNODES": nodes}
    job |= {"SLURM_NTASKS": nodes * devices, "SLURM_NTASKS_PER_NODE": devices, "MASTER_PORT": _free_port()}
    tasks = [
        {**job, "SLURM_NODEID": rank // devices, "SLURM_PROCID": rank, "SLURM_LOCALID": rank % devices}
        for rank in range(nodes * devices)
    ]
    tasks = [{name: str(value) for name, value in task.items()} for task in tasks]
    srun = json.dumps([tasks, str(script), list(map(str, arguments))])
    return run_script("-c", _SRUN, srun, cwd=cwd, env=_finding_this_module())


def run_nodes(
    script: Path,
    *arguments: object,
    nodes: int,
    devices: int,
    cwd: Path,
    min_nodes: int | None = None,
    max_restarts: int = 0,
    rendezvous: dict[str, object] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> list[tuple[int, str]]:
    """Run ``script arguments…`` as a job of ``nodes`` nodes of ``devices`` ranks each, as on a
    cluster: one torchrun agent a node (`_AGENT`), ``min_nodes`` as ``--nnodes min_nodes:nodes``,
    ``max_restarts`` as ``--max-restarts``, the agents meeting by the c10d rendezvous on a free port
    of this machine (``rendezvous``: ``--rdzv-conf``), ``env`` added to their environment.
    Returns each agent's exit code and everything it and its ranks printed (kept in
    ``cwd/node{N}.log``); every process of the job is killed at the end, whatever happened (on a
    timeout, the test fails with what was printed)."""
    port = _free_port()
    settings: dict[str, object] = {
        "min_nodes": min_nodes or nodes,
        "max_nodes": nodes,
        "nproc_per_node": devices,
        "run_id": f"job-{port}",
        "rdzv_backend": "c10d",
        "rdzv_endpoint": f"127.0.0.1:{port}",
        "max_restarts": max_restarts,
    }
    logs = [cwd / f"node{node}.log" for node in range(nodes)]
    agents = []
    for node, log in enumerate(logs):
        # Node 0 hosts the rendezvous, as the node of --rdzv-endpoint does on a cluster: every
        # agent is on this machine's address, and the first to bind it would host it otherwise.
        settings["rdzv_configs"] = {**(rendezvous or {}), "is_host": node == 0}
        job = json.dumps([settings, str(script), list(map(str, arguments))])
        with log.open("w") as output:  # a file, not a pipe: an agent never waits for its reader
            process = subprocess.Popen(
                [sys.executable, "-c", _AGENT, job],
                cwd=cwd,
                env={**_finding_this_module(), **(env or {})},
                start_new_session=True,
                stdout=output,
                stderr=output,
            )
        agents.append(process)
    try:
        deadline = time.monotonic() + timeout
        for agent in agents:
            agent.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        printed = "\n".join(log.read_text()[-3000:] for log in logs)
        raise AssertionError(f"the agents of {script.name} ran past {timeout} s:\n{printed}") from None
    finally:
        for agent in agents:
            end_session(agent)
    return [(agent.returncode, log.read_text()) for agent, log in zip(agents, logs, strict=True)]


def _free_port() -> int:
    """A TCP port of this machine that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _finding_this_module() -> dict[str, str]:
    """This process's environment, with this folder on the path: where `_AGENT` and `_SRUN` import
    this module from."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_TESTS, os.environ.get("PYTHONPATH")]))}


def end_session(process: subprocess.Popen) -> None:
    """Kill every process of ``process``'s session (it and whatever it started), and reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
