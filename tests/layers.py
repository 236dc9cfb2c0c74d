"""The package's layers, lowest first (docs/architecture.md draws them): what
``unit/test_layers.py`` checks the imports against, and ``integration/test_imports.py`` what
``import lightning_canzona`` loads."""

from __future__ import annotations

#: Top-level modules and subpackages of the package, by layer, lowest first.
LAYERS: list[set[str]] = [
    {"compat", "geometry"},  # private torch/Lightning names; how a matrix is cut into slices
    {"rules", "qk_clip"},  # the per-matrix math and its cost; QK-clip's per-layer math
    {"planning"},  # pure planning, and the device model whose prices it charges
    {"config"},  # the one configuration of the plan
    {"distributed"},  # the engine
    {"optim"},  # the optimizers users construct
    {  # the strategy's parts
        "checkpoint",
        "composition",
        "elastic",
        "export",
        "huggingface",
        "launcher",
        "mesh",
        "metrics",
        "optimizer_check",
        "precision",
        "preparation",
        "qk_clip_runtime",
        "telemetry",
        "warning_filters",
    },
    {"fabric", "strategy"},  # the Trainer's and Fabric's strategies
    {""},  # lightning_canzona/__init__.py
    {"cli", "data", "models", "tools"},  # the command line, the tools and the bundled model
]

#: The tools: loaded when their command or example runs, never by ``import lightning_canzona``.
TOOLS = LAYERS[-1]
