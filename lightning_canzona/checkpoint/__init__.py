"""Checkpoints of both strategies: what Lightning's ``ModelParallelStrategy`` leaves out.

- the optimizer state: every owner's matrix state, in either format (`state`), a single file's
  streamed to rank 0 in chunks of bounded size (`streaming`);
- saves that never lose the last good checkpoint, swapped in crash-atomically (`saving`, `swap`),
  in the Trainer's layout or Fabric's (`saving.write_state`);
- files verified against what was saved before anything is loaded (`integrity`);
- one error for a checkpoint that is damaged (`CorruptCheckpointError`) and one for a checkpoint
  that could run code (`UnsafeCheckpointError`), raised on every rank whichever door loads it
  (`errors`);
- the optimizer a checkpoint belongs to, checked before its state is loaded (`identity`);
- reading that runs no code from the checkpoint, a clear error for another model's, and the check
  that a ``ckpt_path`` exists (`reading`); every check before anything loads, and loading at any
  mesh (`loading`).
"""

from lightning_canzona.checkpoint.errors import CorruptCheckpointError, UnsafeCheckpointError
from lightning_canzona.checkpoint.identity import check_same_optimizers, record
from lightning_canzona.checkpoint.integrity import verify, write_manifest
from lightning_canzona.checkpoint.loading import (
    check_before_loading,
    check_file_before_launch,
    load_distributed,
    load_single_file,
)
from lightning_canzona.checkpoint.reading import IDENTITY_KEY, check_compatible, check_path_exists, read_saved
from lightning_canzona.checkpoint.saving import save_atomically, write_state
from lightning_canzona.checkpoint.state import distributed_optimizer_state, full_optimizer_state
from lightning_canzona.checkpoint.swap import recover, remove, replace_with, staging_path

__all__ = [
    "IDENTITY_KEY",
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
    "check_before_loading",
    "check_compatible",
    "check_file_before_launch",
    "check_path_exists",
    "check_same_optimizers",
    "distributed_optimizer_state",
    "full_optimizer_state",
    "load_distributed",
    "load_single_file",
    "read_saved",
    "record",
    "recover",
    "remove",
    "replace_with",
    "save_atomically",
    "staging_path",
    "verify",
    "write_manifest",
    "write_state",
]
