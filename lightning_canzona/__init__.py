"""lightning_canzona: exact, non-redundant, load-balanced matrix optimizers for Lightning.

Importing the package registers the strategies ``"canzona"`` and ``"canzona_notebook"`` (which
starts its ranks by forking, for Jupyter) in Lightning's strategy registry and in Fabric's, and
filters the third-party warnings that are harmless in its runs (`lightning_canzona.warning_filters`).
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES
from lightning.pytorch.strategies import StrategyRegistry

from lightning_canzona.checkpoint import CorruptCheckpointError, UnsafeCheckpointError
from lightning_canzona.config import PlanConfig
from lightning_canzona.export import export_checkpoint
from lightning_canzona.fabric import CanzonaFabricStrategy
from lightning_canzona.optim import SOAP, Muon, NorMuon, Shampoo, matrix_param_groups
from lightning_canzona.qk_clip import QKClip
from lightning_canzona.qk_clip_runtime import attach_qk_clip
from lightning_canzona.strategy import CanzonaStrategy
from lightning_canzona.telemetry import StepTelemetry
from lightning_canzona.warning_filters import ignore_harmless_warnings

__all__ = [
    "SOAP",
    "CanzonaFabricStrategy",
    "CanzonaStrategy",
    "CorruptCheckpointError",
    "Muon",
    "NorMuon",
    "PlanConfig",
    "QKClip",
    "Shampoo",
    "StepTelemetry",
    "UnsafeCheckpointError",
    "attach_qk_clip",
    "export_checkpoint",
    "matrix_param_groups",
]
__version__ = "0.1.0"

ignore_harmless_warnings()


def _register_strategies() -> None:
    """``strategy="canzona"`` and ``"canzona_notebook"`` for the Trainer and for Fabric (in a function:
    a loop at module level would leave ``lightning_canzona.strategy`` naming a class, not the module)."""
    for registry, strategy in (
        (StrategyRegistry, CanzonaStrategy),
        (FABRIC_STRATEGIES, CanzonaFabricStrategy),
    ):
        if "canzona" not in registry:
            registry.register(
                "canzona", strategy, description="FSDP2 × TP with exact, non-redundant matrix optimizers"
            )
        if "canzona_notebook" not in registry:
            registry.register(
                "canzona_notebook",
                strategy,
                description=f"{strategy.__name__} that forks its ranks (Jupyter notebooks)",
                start_method="fork",
            )


_register_strategies()
