"""The in-process launcher: forked ranks never deadlock and never outlive their launch.

Each case runs a small script in its own process session, as a notebook kernel would, with a hard
timeout; whatever happens, the session is killed at the end, so no process is left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from scripts import end_session

from lightning_canzona.launcher import failure_reports_folder, prune_failure_reports

PREAMBLE = """
import os, sys, time
from pathlib import Path
import torch
from lightning import Trainer
from lightning_canzona.data import ByteTextDataModule
from lightning_canzona.models import CausalLanguageModel

def trainer(**kwargs):
    settings = dict(
        strategy="canzona_notebook", accelerator="cpu", devices=2, max_steps=2, limit_val_batches=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    return Trainer(**{**settings, **kwargs})
"""

# The parent runs multi-threaded OpenMP regions of the kinds the model uses (the rotary
# embedding's cos/sin, exp, matmul, add) before it forks the ranks, as a notebook that trained
# or evaluated in its own process does.
AFTER_OPENMP = """
torch.set_num_threads(2)
x = torch.randn(1 << 22)
for _ in range(3):
    torch.cos(x); torch.sin(x); torch.exp(x); x + x
    torch.randn(512, 512) @ torch.randn(512, 512)
fit = trainer()
fit.fit(CausalLanguageModel(preset="tiny"), datamodule=ByteTextDataModule(seq_len=32, batch_size=4))
print("trained", float(fit.callback_metrics["train_loss"]))
"""

# Ranks stuck in training, deaf to SIGINT and SIGTERM as a rank stuck in native code is; each
# writes its pid once it runs.
BLOCKED = """
import signal

# Ctrl-C interrupts this process as it does a terminal's or a notebook kernel's, even where the
# test runs with SIGINT ignored (a shell's background job), which a child would inherit.
signal.signal(signal.SIGINT, signal.default_int_handler)

class Blocks(CausalLanguageModel):
    def training_step(self, batch, batch_idx):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        Path(sys.argv[1], str(os.getpid())).touch()
        time.sleep(600)

trainer().fit(Blocks(preset="tiny"), datamodule=ByteTextDataModule(seq_len=32, batch_size=4))
"""


def _start(script: str, *args: str) -> subprocess.Popen:
    # OMP_NUM_THREADS=2 keeps the ranks' OpenMP regions multi-threaded, where the hazard lives.
    # Without the MASTER_PORT that launches in this process left in its environment: each launch
    # picks a free port of its own, as a fresh kernel does (the module's run at once).
    env = {name: value for name, value in os.environ.items() if name != "MASTER_PORT"}
    env["OMP_NUM_THREADS"] = "2"
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PREAMBLE + script), *args],
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


#: How the launches whose ranks block are stopped.
STOPS = {"interrupted": signal.SIGINT, "killed": signal.SIGKILL}


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> Iterator[dict[str, tuple[subprocess.Popen, Path]]]:
    """The module's launches, started together (each imports Lightning on one core before it
    forks): by name, the process and its folder. ``"after-openmp"`` trains; the `STOPS`' ranks
    block in training, each writing its pid in the folder once it runs."""
    launches = {}
    try:
        launches["after-openmp"] = (_start(AFTER_OPENMP), tmp_path_factory.mktemp("after-openmp"))
        for how in STOPS:
            folder = tmp_path_factory.mktemp(how)
            launches[how] = (_start(BLOCKED, str(folder)), folder)
        yield launches
    finally:
        for process, _ in launches.values():
            end_session(process)


def test_forked_ranks_train_after_the_parent_ran_openmp_regions(launches) -> None:
    process, _ = launches["after-openmp"]
    try:
        output, _ = process.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("the forked ranks hung (fork after a multi-threaded OpenMP region)")
    finally:
        end_session(process)
    assert process.returncode == 0, output[-3000:]
    assert "trained" in output


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("how", STOPS)
def test_ranks_do_not_outlive_an_interrupted_or_killed_launch(launches, how) -> None:
    process, folder = launches[how]
    try:
        deadline = time.monotonic() + 180
        while len(list(folder.iterdir())) < 2:
            assert process.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.2)
        ranks = [int(path.name) for path in folder.iterdir()]
        os.kill(process.pid, STOPS[how])
        deadline = time.monotonic() + 20
        while any(map(_alive, ranks)) and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = [rank for rank in ranks if _alive(rank)]
        launch = process.poll()
    finally:
        end_session(process)
    printed = process.stdout.read() if process.stdout else ""
    assert not alive, f"ranks {alive} outlived their launch (exit code {launch}):\n{printed[-3000:]}"


@pytest.mark.parametrize("fabric", [False, True], ids=["trainer", "fabric"])
def test_a_kernel_that_used_cuda_is_told_what_to_do_before_any_rank_is_forked(monkeypatch, fabric) -> None:
    # Forked ranks cannot use CUDA once their parent has: every rank would fail in its first
    # CUDA call ("Cannot re-initialize CUDA in forked subprocess"). The launching process says
    # so once, before it forks. (No GPU needed: the strategy's devices are declared CUDA.)
    import multiprocessing

    import torch

    import lightning_canzona as lc
    from lightning_canzona.launcher import FabricInProcessLauncher, InProcessLauncher

    strategy = (lc.CanzonaFabricStrategy if fabric else lc.CanzonaStrategy)(start_method="fork")
    strategy.parallel_devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    launcher = (FabricInProcessLauncher if fabric else InProcessLauncher)(strategy, "fork")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match=r"has already used CUDA .* Restart the kernel"):
        launcher.launch(print, "a rank ran")
    assert not multiprocessing.active_children()


def _adopted_rank_names_its_folder(write: int) -> None:
    """In a forked child: fork a rank, end (its launcher ending first), and have the rank, once
    adopted, write its pid, its new parent's and its report folder's name to ``write``."""
    try:  # whatever happens, the child never returns into pytest
        launcher = os.getpid()
        if os.fork():
            os._exit(0)
        while os.getppid() == launcher:
            time.sleep(0.01)
        os.write(write, f"{os.getpid()} {os.getppid()} {failure_reports_folder().name}".encode())
    finally:
        os._exit(0)


def test_a_rank_whose_launcher_ended_names_its_report_folder_for_itself() -> None:
    stale = Path(tempfile.gettempdir()) / "lightning_canzona-1"  # init's: what earlier versions wrote
    stale.mkdir(exist_ok=True)
    read, write = os.pipe()
    launcher = os.fork()  # no interpreter to start: the children only read process ids
    if launcher == 0:
        os.close(read)
        _adopted_rank_names_its_folder(write)
    os.close(write)
    os.waitpid(launcher, 0)
    with os.fdopen(read) as pipe:  # until the rank has written and ended
        rank, adopter, name = pipe.read().split()
    # Adopted by init (PID 1, as a container's first process is), it names the folder for itself,
    # removed once it has ended; by a subreaper, for that process, as for any launching process.
    assert name == f"lightning_canzona-{rank if adopter == '1' else adopter}"
    prune_failure_reports()
    assert not stale.exists()
