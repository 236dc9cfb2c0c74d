"""Third-party warnings that a run of lightning_canzona triggers where they are harmless, filtered.

Each filter matches one message and the module (or logger) that issues it, never a whole category,
and says why the warning does not apply; ``tests/distributed/test_quiet.py`` shows each harmless. Warnings of
this package are never filtered: a correct run prints none of them.
"""

from __future__ import annotations

import logging
import re
import warnings
from typing import Any

from lightning_canzona.compat import PYTREE_MODULE_PATTERN, REDISTRIBUTE_LOGGER


class SequentialGathers(logging.Filter):
    """Drops DTensor's note that gathering a tensor sharded over two mesh dimensions takes two
    collectives, which "may give inconsistent results between ranks due to different reduction
    orders", where that cannot happen:

    - all-gathers: a gather reorders no sum, so only the note's latency remark applies, and the
      whole tensors gathered here (weights handed back to a notebook, exports) are gathered once;
    - the all-reduces of a norm (``_NormPartial``: the gradient norm of clipping across meshes,
      `distributed.clipping`): one scalar per mesh, reduced in the same order on every rank.

    The same note for any other reduction (``reduce_scatter``, a sum's ``all_reduce``) still shows.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        args: Any = record.args
        if not (str(record.msg).startswith("While redistributing from") and isinstance(args, tuple)):
            return True
        gathers = len(args) > 3 and args[3] == "all_gather"
        norms = len(args) > 3 and args[3] == "all_reduce" and "_NormPartial" in str(args[0])
        return not (gathers or norms)


def ignore_harmless_warnings() -> None:
    """Filters that hold for every run (installed when the package is imported)."""
    # Lightning's batch flattening (lightning.pytorch.utilities._pytree, used by its combined data
    # loaders) builds torch's LeafSpec, which torch 2.13 deprecates: a notice to Lightning,
    # printed once per rank; what the flattening returns is unchanged.
    warnings.filterwarnings(
        "ignore",
        message=re.escape("`isinstance(treespec, LeafSpec)` is deprecated"),
        module=PYTREE_MODULE_PATTERN,
    )
    redistribute = logging.getLogger(REDISTRIBUTE_LOGGER)
    if not any(isinstance(f, SequentialGathers) for f in redistribute.filters):
        redistribute.addFilter(SequentialGathers())


def ignore_view_warning_of_unresharded_root(root: type) -> None:
    """FSDP2's warning that the root unit ``root`` returned a view tensor, where it is harmless.

    An in-place op on a view drops the hook that all-gathers the unit's parameters before its
    backward. The root of a composition (`lightning_canzona.composition`) whose parameters FSDP2
    keeps gathered from forward to backward has nothing to gather then; its views come from
    tensor parallelism (``DTensor.to_local``: a ``transformers`` model's gathered logits).
    """
    warnings.filterwarnings(
        "ignore",
        message=rf"FSDP2-wrapped module \(FSDP{re.escape(root.__name__)}\) returned a view tensor",
        module=r"torch\.distributed\.fsdp\.",
    )
