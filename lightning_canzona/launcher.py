"""Starting the ranks from the current process: ``fork`` (notebooks) or ``spawn``."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput


class InProcessLauncher(_MultiProcessingLauncher):
    """Starts the ranks from this process (``fork`` in notebooks, or ``spawn``).

    Only metrics and the trainer state come back to the launching process: a model sharded over
    the mesh has no single copy to return, so keep weights with a checkpoint.
    """

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        if self._strategy.local_rank != 0:
            return None
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback else None
        return _WorkerOutput(best_model_path, None, trainer.state, results, self.get_extra_results(trainer))

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)
        # The rank's process ends here. Left to interpreter exit, the process group's teardown can
        # race gloo's worker threads and abort the rank ("terminate called without an active
        # exception") after a successful run.
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
