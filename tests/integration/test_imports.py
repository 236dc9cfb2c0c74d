"""What ``import lightning_canzona`` loads, in a fresh interpreter."""

from __future__ import annotations

from layers import TOOLS
from scripts import IMPORTED


def test_importing_the_library_loads_none_of_its_tools(examples) -> None:
    # In a fresh interpreter: the one that runs the examples, before it runs any.
    _, loaded, _ = examples[IMPORTED]
    assert "lightning_canzona.strategy" in loaded.split()  # what registers the strategies
    tools = {m for m in loaded.split() if m.startswith("lightning_canzona.") and m.split(".")[1] in TOOLS}
    assert not tools, tools
