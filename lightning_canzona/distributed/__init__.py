"""The distributed engine: DTensor layouts, packed all-to-all exchanges, the micro-group pipeline."""

from lightning_canzona.distributed.engine import Entry, MeshEngine, StepStats

__all__ = ["Entry", "MeshEngine", "StepStats"]
