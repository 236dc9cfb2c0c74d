import pytest
import torch


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
