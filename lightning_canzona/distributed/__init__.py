"""The distributed engine: DTensor layouts, packed all-to-all exchanges, the micro-group pipeline."""

from lightning_canzona.distributed.engine import MeshEngine
from lightning_canzona.distributed.runtime import Entry, StepStats

__all__ = ["Entry", "MeshEngine", "StepStats"]
