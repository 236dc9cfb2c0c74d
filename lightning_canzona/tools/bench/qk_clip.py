"""What QK-clip costs a training iteration: the same model and batch with and without it.

For each preset and sequence length, two copies of the bundled decoder without QK-norm train one
iteration each (forward, backward, `Muon` step), one of them with ``qk_clip``, timed interleaved
on one process (`bench.timing.median_seconds`). QK-clip's cost is the difference: the extra
``q·kᵀ`` of each attention call that records the largest logits, and after the step the clip itself
(timed alone too: rescaling the query/key rows; on a mesh add one all-reduce of 4 bytes per head).
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

import lightning_canzona as lc
from lightning_canzona.models.qwen3 import Qwen3, resolve_config
from lightning_canzona.tools.bench.timing import median_seconds
from lightning_canzona.tools.tables import table


@dataclass(frozen=True)
class Row:
    """One preset and sequence length: iteration times without and with QK-clip, the clip alone."""

    preset: str
    seq_len: int
    batch_size: int
    plain_ms: float
    clipped_ms: float
    clip_ms: float

    @property
    def ratio(self) -> float:
        return self.clipped_ms / self.plain_ms


def measure(
    presets: list[str], seq_lens: list[int], batch_size: int, dtype: torch.dtype, repeats: int = 5
) -> list[Row]:
    """Time both iterations, interleaved, for every preset and sequence length."""
    rows = []
    for preset in presets:
        config = replace(resolve_config(preset), qk_norm=False)
        torch.manual_seed(0)
        plain = Qwen3(config).to(dtype)
        clipped = copy.deepcopy(plain)
        settings = {"lr": 0.02, "weight_decay": 0.01}
        plain_optimizer = lc.Muon(lc.matrix_param_groups(plain), **settings)
        clipped_optimizer = lc.Muon(lc.matrix_param_groups(clipped), **settings, qk_clip=lc.QKClip())
        runtime = lc.attach_qk_clip(clipped, clipped_optimizer)
        for seq_len in seq_lens:
            tokens = torch.randint(config.vocab_size, (batch_size, seq_len + 1))

            def iteration(model: Qwen3, optimizer: lc.Muon, tokens: torch.Tensor = tokens) -> None:
                logits = model(tokens[:, :-1])
                F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
                optimizer.step()
                optimizer.zero_grad()

            seconds = median_seconds(
                {
                    "plain": functools.partial(iteration, plain, plain_optimizer),
                    "clipped": functools.partial(iteration, clipped, clipped_optimizer),
                    "clip": runtime.clip,
                },
                repeats=repeats,
            )
            rows.append(
                Row(
                    preset,
                    seq_len,
                    batch_size,
                    1e3 * seconds["plain"],
                    1e3 * seconds["clipped"],
                    1e3 * seconds["clip"],
                )
            )
    return rows


def format_table(rows: list[Row]) -> str:
    """The rows as a table (`lightning_canzona.tools.tables.table`)."""
    headers = ["preset", "seq", "batch", "iteration ms", "+ QK-clip ms", "ratio", "clip ms"]
    cells = [
        [
            row.preset,
            row.seq_len,
            row.batch_size,
            f"{row.plain_ms:.2f}",
            f"{row.clipped_ms:.2f}",
            f"{row.ratio:.3f}",
            f"{row.clip_ms:.3f}",
        ]
        for row in rows
    ]
    return table(headers, cells, margin=1)
