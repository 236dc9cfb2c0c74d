"""Starting the ranks: Lightning's script launcher (``popen``: the script re-run per rank) or from
the current process (``fork`` in notebooks, or ``spawn``), each after the strategy's preflight,
and how the ranks report a failure.

**Preflight.** Both launchers first run the strategy's checks in the launching process
(`Preflight`: the mesh for the model, the checkpoint path, and when fitting the optimizers'
settings), so that a mistake is one error, in seconds, before any rank starts.

**One report per failure.** An exception that ends a rank other than 0 prints one line, its
traceback going to a file (`report_failures_briefly`): a failure that every rank meets prints one
traceback, not one per rank. The files stay while the launching process lives, and the next
launch after it has ended removes them (`prune_failure_reports`).

Three hazards of starting ranks from a live process are handled here:

- **fork after OpenMP.** GNU OpenMP's thread pool does not survive ``fork``: a child forked from
  a thread that has run a multi-threaded OpenMP region (any large enough torch CPU op in a
  notebook cell, such as ``cos`` of a rotary embedding) deadlocks in its first OpenMP region of
  its own, on some CPUs. The pool belongs to the thread that used it, so the ranks are forked
  from a new thread that has never run one.
- **fork after CUDA.** A process forked from one that has used CUDA cannot use it
  (``Cannot re-initialize CUDA in forked subprocess``, in every rank). A notebook that put a
  model or tensor on a GPU before ``fit`` is told so in one error, before any rank starts
  (`refuse_fork_after_cuda`): switching to ``spawn`` behind its back would fail on the classes
  it defined (a spawned rank imports them by name).
- **Orphans.** Ranks must not outlive their launch. Each rank asks the kernel to kill it when
  the thread that started it ends (``PR_SET_PDEATHSIG`` on Linux), which covers a launching
  process that is killed; a launch interrupted in the notebook (``KeyboardInterrupt``) kills its
  ranks before it returns; a failed rank makes torch stop the others.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import TrainerFn

from lightning_canzona.checkpoint.state import full_model_state
from lightning_canzona.compat import (
    FabricMultiProcessingLauncher,
    MultiProcessingLauncher,
    PathLike,
    SubprocessScriptLauncher,
    WorkerOutput,
)

#: What a launcher checks before any rank starts, given the call's ``ckpt_path`` and whether it fits.
Preflight = Callable[[PathLike | None, bool], None]

#: ``prctl`` option: the signal a process gets when the thread that created it ends.
_PR_SET_PDEATHSIG = 1


def run_preflight(
    preflight: Preflight,
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    trainer: pl.Trainer | None,
) -> None:
    """Run ``preflight`` for a launch of ``function`` (the trainer's ``_fit_impl``,
    ``_validate_impl``…) with ``args`` and ``kwargs``: its ``ckpt_path``, and whether it fits."""
    try:
        ckpt_path = inspect.signature(function).bind(*args, **kwargs).arguments.get("ckpt_path")
    except (TypeError, ValueError):  # not a trainer entry point: no path to check
        ckpt_path = None
    preflight(ckpt_path, trainer is not None and trainer.state.fn == TrainerFn.FITTING)


class ScriptLauncher(SubprocessScriptLauncher):
    """Lightning's launcher that re-runs the script once per rank, after ``preflight``.

    The launching process becomes rank 0; the others start only once ``preflight`` has passed.
    """

    def __init__(self, strategy: Strategy, preflight: Preflight) -> None:
        super().__init__(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)
        self._preflight = preflight

    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        run_preflight(self._preflight, function, args, kwargs, trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class ForkSafeLaunch:
    """What makes Lightning's multiprocessing launchers (the Trainer's and Fabric's) safe to start
    ranks from a live process (see the module docstring): the ranks are started from a fresh
    thread, die with it, are killed when the launch is interrupted, and leave without the
    interpreter's shutdown once they succeeded. Mixed in before the launcher it makes safe."""

    _strategy: Any

    def launch(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        """Run the launcher's launch in a new thread, and wait for it here.

        The thread lives as long as the ranks (it joins them), so that they die with it.

        Raises:
            RuntimeError: Forking ranks for CUDA from a process that has used CUDA
                (`refuse_fork_after_cuda`), before any rank starts.
        """
        refuse_fork_after_cuda(self._start_method, self._strategy.root_device)  # type: ignore[attr-defined]
        return in_fresh_thread(super().launch, function, *args, **kwargs)  # type: ignore[misc]

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        _die_with_launching_thread()
        super()._wrapping_function(*args, **kwargs)  # type: ignore[misc]
        # The rank's process ends here, its results sent (a SimpleQueue writes them at once). A
        # gloo thread may still be freeing the tensors of a collective that ran last and that the
        # package does not keep (`inflight`): the gather of the weights handed back runs DTensor's.
        # Freed during the interpreter's shutdown, it aborts the rank after a successful run
        # ("terminate called without an active exception", seen once under load): so the groups
        # go while the interpreter is whole, and a successful rank exits without that shutdown,
        # as the test harness's ranks do. A failed rank never gets here: torch reports its error.
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


class InProcessLauncher(ForkSafeLaunch, MultiProcessingLauncher):
    """Starts the Trainer's ranks from this process (``fork`` in notebooks, or ``spawn``), after
    ``preflight``.

    Metrics and the trainer state come back to the launching process, and with ``return_weights``
    the weights a ``fit`` trained, into the launching process's module in its own (unsharded) form.
    """

    def __init__(
        self,
        strategy: Strategy,
        start_method: str,
        preflight: Preflight | None = None,
        return_weights: bool = False,
    ) -> None:
        super().__init__(strategy, start_method=start_method)
        self._preflight = preflight
        self._return_weights = return_weights

    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if self._preflight is not None:
            run_preflight(self._preflight, function, args, kwargs, trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> WorkerOutput | None:
        """Rank 0's results for the launching process, and after ``fit`` (``return_weights``) the
        trained weights, gathered whole from every rank into a temporary file: Lightning's launcher
        then loads them into the launching process's module (`_recover_results_in_main_process`)."""
        weights = None
        if self._return_weights and trainer.state.fn == TrainerFn.FITTING:
            weights = full_model_state(trainer.lightning_module)  # collective: every rank joins
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if weights is not None:
            weights_path = os.path.join(tempfile.mkdtemp(), "weights.pt")
            torch.save(weights, weights_path)
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback else None
        extra = self.get_extra_results(trainer)
        return WorkerOutput(best_model_path, weights_path, trainer.state, results, extra)


class FabricInProcessLauncher(ForkSafeLaunch, FabricMultiProcessingLauncher):
    """Starts Fabric's ranks from this process (``fabric.launch(function)`` in a notebook, by
    ``fork``, or ``spawn``); rank 0's return value comes back.

    It comes back through a temporary file, as the Trainer's weights do: Fabric's launcher reads
    its queue once every rank has ended, so rank 0 could neither finish writing a large result
    into the queue's pipe nor, once ended, hand over the memory of the tensors in a small one.
    """

    def launch(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        path = super().launch(functools.partial(_saved_on_rank_zero, function), *args, **kwargs)
        try:
            return torch.load(path, weights_only=False)  # what rank 0 of this launch returned
        finally:
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def in_fresh_thread(start: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``start(*args, **kwargs)``, a function that starts ranks and joins them, run in a new
    thread that has run no OpenMP region (see the module docstring), and waited for here; the
    ranks it started are killed if the wait is interrupted (KeyboardInterrupt in a notebook: no
    rank may live on). Returns what ``start`` returns and raises what it raises."""
    before = set(multiprocessing.active_children())
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = start(*args, **kwargs)
        except BaseException as error:
            outcome["error"] = error

    launching = threading.Thread(target=run, name="lightning_canzona-launch", daemon=True)
    launching.start()
    try:
        while launching.is_alive():
            launching.join(timeout=0.2)
    except BaseException:
        for rank in set(multiprocessing.active_children()) - before:
            rank.kill()
        launching.join(timeout=30)
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


def refuse_fork_after_cuda(start_method: str, device: torch.device) -> None:
    """Refuse to fork ranks that compute on CUDA ``device``s from this process once it has used
    CUDA, which a forked process cannot: say what to do instead, before any rank starts.

    Raises:
        RuntimeError: ``start_method`` is ``fork``, ``device`` is a GPU and CUDA is initialized here.
    """
    if start_method == "fork" and device.type == "cuda" and torch.cuda.is_initialized():
        raise RuntimeError(
            "canzona_notebook forks this process into its ranks, and this process has already used "
            "CUDA (a model or tensor was put on a GPU here), which forked ranks cannot use. Restart "
            "the kernel and keep this process off the GPU until training starts: build, load and "
            "train the model here on the CPU (the ranks move it to their GPUs), or run a script "
            'with strategy="canzona".'
        )


def _saved_on_rank_zero(function: Callable[..., Any], *args: Any, **kwargs: Any) -> str | None:
    """Run ``function``; on rank 0, save what it returns to a temporary file and return its path."""
    result = function(*args, **kwargs)
    if os.environ.get("LOCAL_RANK") != "0":  # set by the launcher for each rank it starts
        return None
    path = os.path.join(tempfile.mkdtemp(), "result.pt")
    torch.save(result, path)
    return path


def _die_with_launching_thread() -> None:
    """Have the kernel kill this rank when the thread that started it ends (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the launcher was already gone before the request took effect
        os._exit(1)


#: The folder of the failure reports of the ranks that one process launched: ``…-<its pid>``.
_REPORTS = "lightning_canzona-"


def report_failures_briefly(rank: int) -> None:
    """On rank ``rank`` (not 0), print an uncaught exception as one line and its traceback to a file.

    A failure that every rank meets (a bad batch, a shape) would otherwise print one traceback per
    rank, interleaved; rank 0 prints its own in full, and a failure of this rank alone is still
    named, with where its traceback is: ``rank<N>.txt`` in a folder of the process that launched
    the ranks (a script, a notebook's kernel, ``torchrun``; `failure_reports_folder`), where the
    rank's next failure overwrites it; the first launch after that process has ended removes the folder
    (`prune_failure_reports`, run here). Only the display of an exception that ends the process
    changes: code that catches it sees it unchanged. (torch's ``init_process_group`` installs a
    hook the same way, to prefix the lines with the rank; this one is installed after it.)
    """
    if rank == 0:
        return
    prune_failure_reports()
    folder = failure_reports_folder()

    def report(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        path = folder / f"rank{rank}.txt"
        text = "".join(traceback.format_exception(kind, error, trace))
        try:
            folder.mkdir(exist_ok=True)
            path.write_text(text)
            where = f"its traceback is in {path}"
        except OSError:
            where = "its traceback could not be written"
        summary = (str(error).strip().splitlines() or [""])[0]
        sys.stderr.write(f"[rank{rank}]: {kind.__name__}: {summary} ({where})\n")
        sys.stderr.flush()

    sys.excepthook = report


def failure_reports_folder() -> Path:
    """The folder of this rank's failure report: named for the process that launched it (its
    parent), or for this rank itself where the parent is PID 1 — ``init``, which adopted the rank
    after its launcher ended, or a container's first process — which outlives every launch, so
    that the folder is removed once the rank has ended."""
    parent = os.getppid()
    return Path(tempfile.gettempdir()) / f"{_REPORTS}{parent if parent != 1 else os.getpid()}"


def prune_failure_reports() -> None:
    """Remove the failure reports (`report_failures_briefly`) of launches whose launching process
    has ended: by then its ranks have ended too, and their one-line messages were printed (and a
    folder named for ``init``, which earlier versions wrote and never removed)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{_REPORTS}*"):
        pid = folder.name.removeprefix(_REPORTS)
        if folder.is_dir() and pid.isdigit() and (int(pid) == 1 or not _alive(int(pid))):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal: only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True
