"""How elementwise updates are written into parameters, and low-precision ones rounded.

**To nearest, once per operation** (the default), as ``torch.optim`` does: each update of a bf16 or
fp16 tensor (the weight decay, the step, AdamW's moments) computes in float32 and rounds once.
`scale_` exists because ``torch._foreach_mul_`` with a Python scalar does not on a CPU: it rounds
the scalar to the tensor's dtype first (a decay factor of 0.998 becomes bf16's 0.996, twice the
decay).

**Stochastically** (`StochasticRounding`): the decay and the step are computed on a float32 copy
and written back rounded up or down at random, with the probability that makes the expected
value exact, as torchao's bf16 optimizers do. A bf16 weight then moves by updates far below its
precision (0.3 has a bf16 spacing of 0.002: a step of 1e-4 rounded to nearest never lands) on
average over steps. The random bits are a function of the parameter's name, the rank's shard
and the step, never of a rank's random state: replicas of a parameter (over data or tensor
parallelism) round alike and stay equal, and a resumed run rounds as the uninterrupted one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_canzona.compat import foreach_mul_

#: Dtypes that stochastic rounding writes into (bf16 keeps float32's exponent: its values are
#: float32 values with the low 16 bits zero).
STOCHASTIC_DTYPES = (torch.bfloat16,)


def scale_(tensors: Sequence[Tensor], factor: float) -> None:
    """``tensor *= factor`` for each of ``tensors`` (on one device), rounded once as ``Tensor.mul_``.

    On a CPU the factor goes in as a 0-dim float64 tensor, which the kernels multiply in the
    tensors' compute precision (float32 for bf16), bit for bit as ``Tensor.mul_`` with a Python
    scalar; accelerators' foreach kernels already take a scalar at that precision (and a host
    tensor would cost a copy to the device).
    """
    if not tensors:
        return
    if tensors[0].device.type == "cpu":
        foreach_mul_(list(tensors), torch.full((), factor, dtype=torch.float64))
    else:
        foreach_mul_(list(tensors), factor)


@dataclass(frozen=True)
class StochasticRounding:
    """Stochastic rounding of one step's writes into bf16 parameters.

    Attributes:
        step: The step's number (``param_groups[i]["rounding_step"]``), the same on every rank.
    """

    step: int

    @contextmanager
    def writes(self, targets: Sequence[Tensor], keys: Sequence[str]) -> Iterator[list[Tensor]]:
        """Yield what to update in place instead of ``targets``: a float32 copy of each bf16
        target, the others themselves; on exit each copy is rounded into its target.

        ``keys`` name each target's elements uniquely and alike on every rank that holds the
        same elements (`lightning_canzona.distributed.runtime.shard_key`).
        """
        work = [t.float() if t.dtype in STOCHASTIC_DTYPES else t for t in targets]
        yield work
        for target, value, key in zip(targets, work, keys):
            if value is not target:
                round_stochastically_(target, value, self.seed(key))

    def seed(self, key: str) -> int:
        """A 63-bit seed for ``key`` at this step (the same in every process and on every rank)."""
        digest = hashlib.blake2b(f"{self.step}:{key}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1


def round_stochastically_(target: Tensor, value: Tensor, seed: int) -> None:
    """Write float32 ``value`` into bf16 ``target``, rounded up or down at random: up with
    probability equal to the fraction of the bf16 spacing that ``value`` lies above the lower one.

    A bf16 value is a float32 value with the low 16 bits zero: adding 16 random bits to the
    float32 bit pattern and truncating them rounds the magnitude up exactly with that
    probability (a carry into the exponent is the next binade's first value).
    """
    generator = torch.Generator(device=value.device).manual_seed(seed)
    noise = torch.randint(
        0, 1 << 16, value.shape, generator=generator, device=value.device, dtype=torch.int32
    )
    bits = value.contiguous().view(torch.int32)
    bits.add_(noise).bitwise_and_(-(1 << 16))
    target.copy_(bits.view(torch.float32))
