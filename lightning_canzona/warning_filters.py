"""Third-party warnings that a run of lightning_canzona triggers where they are harmless, filtered.

Each filter matches one message and the module that issues it, never a whole category, and says
why the warning does not apply; ``tests/test_quiet.py`` shows each harmless. Warnings of this
package are never filtered: a correct run prints none of them.
"""

from __future__ import annotations

import re
import warnings


def ignore_harmless_warnings() -> None:
    """Filters that hold for every run (installed when the package is imported)."""
    # Lightning's batch flattening (lightning.pytorch.utilities._pytree, used by its combined data
    # loaders) builds torch's LeafSpec, which torch 2.13 deprecates: a notice to Lightning,
    # printed once per rank; what the flattening returns is unchanged.
    warnings.filterwarnings(
        "ignore",
        message=re.escape("`isinstance(treespec, LeafSpec)` is deprecated"),
        module=r"lightning\.pytorch\.utilities\._pytree",
    )


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
