"""How a single-file save cuts owners' state into chunks (`lightning_canzona.checkpoint.streaming`):
every byte once, in order, no chunk over its capacity. (The stream itself, its memory and its
failures: tests/integration/test_checkpoints.py.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_canzona.checkpoint.streaming import layout_of, plan_chunks, tensor_sizes


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 50), max_size=8), capacity=st.integers(1, 40))
def test_chunks_carry_every_byte_once_in_order_and_fill_up_to_their_capacity(sizes, capacity) -> None:
    chunks = plan_chunks(sizes, capacity)
    spans = [span for chunk in chunks for span in chunk.spans]
    carried = [(span.index, byte) for span in spans for byte in range(span.start, span.stop)]
    assert carried == [(index, byte) for index, size in enumerate(sizes) for byte in range(size)]
    for chunk in chunks:
        assert chunk.spans and all(span.stop > span.start for span in chunk.spans)
        # Packed end to end from the chunk's start.
        offsets = [span.offset for span in chunk.spans]
        assert offsets == [0, *(span.in_chunk.stop for span in chunk.spans[:-1])]
        assert chunk.nbytes <= capacity
    # Each chunk but the last is full: as few broadcasts as the capacity allows.
    assert all(chunk.nbytes == capacity for chunk in chunks[:-1])


def test_a_layout_holds_each_tensors_shape_and_dtype_and_sizes_its_bytes() -> None:
    held = {
        "w": {"left": torch.zeros(3, 4), "step": torch.tensor(2)},
        "v": {},  # a matrix whose owner keeps no state (Muon's) is still named
        "b": {"bits": torch.zeros(5, dtype=torch.bfloat16)},
    }
    layout = layout_of(held)
    assert layout == {
        "w": {"left": ((3, 4), torch.float32), "step": ((), torch.int64)},
        "v": {},
        "b": {"bits": ((5,), torch.bfloat16)},
    }
    assert tensor_sizes(layout) == [48, 8, 10]
    with pytest.raises(ValueError, match="at least one byte"):
        plan_chunks([4], 0)
