"""A LightningModule's optimizers built once in the launching process, before any rank starts.

``configure_optimizers`` runs on the ranks once the process group, the mesh and the composition
exist: an optimizer that refuses its settings there (a misspelt keyword, a learning rate out of
range) fails on every rank, after all of that. `check_optimizer_settings` calls it once in the
launching process, on the module's parameters as they are there (before sharding), and raises
such a refusal at once; `CanzonaStrategy.preflight` runs it when fitting.

Only an optimizer's refusal of its own settings is raised (`refuses_its_settings`): a call of
the same optimizer on the ranks refuses them the same way. Whatever else ``configure_optimizers``
raises here is left to the ranks, where it runs as it always does: code that needs the trainer
(``self.trainer.estimated_stepping_batches``, ``self.trainer.model``), the mesh, or parameters
that ``configure_model`` creates. The call's effects stay here: the module is detached from its
trainer meanwhile, what it prints and warns is dropped, the random number generators are
restored, and the optimizers it built are let go.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import traceback
import warnings
from collections.abc import Iterator

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.seed import isolate_rng
from torch.optim import Optimizer

from lightning_canzona.compat import detached_from_trainer

#: The TypeError of a call whose arguments a class's ``__init__`` does not take, and the class.
_REFUSED_CALL = re.compile(
    r"^(\w+)(?:\.__init__)?\(\) (?:got an unexpected keyword|got multiple values|missing \d+ required|takes )"
)
#: This package: what it raises while an optimizer is built is a refusal of the settings.
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def check_optimizer_settings(module: LightningModule) -> None:
    """Call ``module.configure_optimizers()`` and raise an optimizer's refusal of its settings.

    Raises:
        TypeError: An optimizer was called with a keyword it does not take (or without one it
            needs), or refused the type of a setting.
        ValueError: An optimizer refused the value of a setting (a learning rate out of range).
    """
    refusal = None
    with _contained(module):
        try:
            module.configure_optimizers()
        except Exception as error:  # anything but a refusal of settings is the ranks' to meet
            refusal = error if refuses_its_settings(error) else None
    if refusal is not None:
        raise refusal


def refuses_its_settings(error: BaseException) -> bool:
    """Whether ``error`` is an optimizer refusing the settings it was called with.

    That is a TypeError of the call of an optimizer class (a keyword it does not take), or a
    TypeError or ValueError that an optimizer's constructor raised in its own code: in the
    module of its class or of a base class other than torch's ``Optimizer`` (which concerns the
    parameters: an empty list, a non-leaf tensor), or in this package. One raised by code that
    the constructor calls elsewhere (``torch.distributed`` before there is a process group) may
    not happen on the ranks, so it is not one.
    """
    if not isinstance(error, (TypeError, ValueError)):
        return False
    called = _REFUSED_CALL.match(str(error))
    if isinstance(error, TypeError) and called and called.group(1) in _optimizer_class_names():
        return True
    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
    constructed = [
        type(frame.f_locals["self"])
        for frame in frames
        if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), Optimizer)
    ]
    own_files = {
        _source_file(cls)
        for optimizer in constructed
        for cls in optimizer.__mro__
        if issubclass(cls, Optimizer) and cls is not Optimizer
    }
    raised_in = frames[-1].f_code.co_filename
    return bool(constructed) and (raised_in in own_files or os.path.abspath(raised_in).startswith(_PACKAGE))


def _source_file(cls: type) -> str | None:
    return getattr(sys.modules.get(cls.__module__), "__file__", None)


def _optimizer_class_names() -> set[str]:
    names, classes = set(), [Optimizer]
    while classes:
        cls = classes.pop()
        names.add(cls.__name__)
        classes.extend(cls.__subclasses__())
    return names


@contextlib.contextmanager
def _contained(module: LightningModule) -> Iterator[None]:
    """The effects of user code on the launching process kept out of the run that follows."""
    with (
        detached_from_trainer(module),
        isolate_rng(include_cuda=False),  # CUDA untouched: the ranks may be forked from here
        warnings.catch_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        warnings.simplefilter("ignore")
        yield
