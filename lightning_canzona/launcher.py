"""Starting the ranks from the current process: ``fork`` (notebooks) or ``spawn``.

Two hazards of starting ranks from a live process are handled here:

- **fork after OpenMP.** GNU OpenMP's thread pool does not survive ``fork``: a child forked from
  a thread that has run a multi-threaded OpenMP region (any large enough torch CPU op in a
  notebook cell, such as ``cos`` of a rotary embedding) deadlocks in its first OpenMP region of
  its own, on some CPUs. The pool belongs to the thread that used it, so the ranks are forked
  from a new thread that has never run one.
- **Orphans.** Ranks must not outlive their launch. Each rank asks the kernel to kill it when
  the thread that started it ends (``PR_SET_PDEATHSIG`` on Linux), which covers a launching
  process that is killed; a launch interrupted in the notebook (``KeyboardInterrupt``) kills its
  ranks before it returns; a failed rank makes torch stop the others.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput

#: ``prctl`` option: the signal a process gets when the thread that created it ends.
_PR_SET_PDEATHSIG = 1


class InProcessLauncher(_MultiProcessingLauncher):
    """Starts the ranks from this process (``fork`` in notebooks, or ``spawn``).

    Only metrics and the trainer state come back to the launching process: a model sharded over
    the mesh has no single copy to return, so keep weights with a checkpoint.
    """

    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        """Run Lightning's launch in a new thread, and wait for it here (see the module docstring).

        The thread lives as long as the ranks (it joins them), so that they die with it.
        """
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["result"] = super(InProcessLauncher, self).launch(
                    function, *args, trainer=trainer, **kwargs
                )
            except BaseException as error:
                outcome["error"] = error

        launching = threading.Thread(target=run, name="lightning_canzona-launch", daemon=True)
        launching.start()
        try:
            while launching.is_alive():
                launching.join(timeout=0.2)
        except BaseException:  # KeyboardInterrupt in a notebook: no rank may live on
            self._kill_ranks()
            launching.join(timeout=30)
            raise
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("result")

    def _kill_ranks(self) -> None:
        for process in getattr(self, "procs", []):
            if process.is_alive():
                process.kill()

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        if self._strategy.local_rank != 0:
            return None
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback else None
        return _WorkerOutput(best_model_path, None, trainer.state, results, self.get_extra_results(trainer))

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        _die_with_launching_thread()
        super()._wrapping_function(*args, **kwargs)
        # The rank's process ends here: its groups go while the interpreter is whole, not in its
        # shutdown, where a gloo thread that still frees a tensor aborts the rank (`inflight`).
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _die_with_launching_thread() -> None:
    """Have the kernel kill this rank when the thread that started it ends (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the launcher was already gone before the request took effect
        os._exit(1)
