"""Muon's and NorMuon's ``compile`` setting: Newton–Schulz compiled with ``torch.compile``.

Where the setting says so (`compiles`), the steps of
`lightning_canzona.rules.newton_schulz.newton_schulz` run compiled, in each of its four forms, for
whole matrices and stacks: all of its products. The normalisation before them stays eager: its
norm is a reduction, which inductor sums in another order than eager (in float32 a different
last bit, then a different iteration). The steps are compiled

- with ``fullgraph=True``: a graph break is an error, never a silent fall back to eager;
- with ``dynamic=False``: one graph per shape, dtype and form, the first step compiling them all
  and later steps none (a symbolic size would also cost
  `lightning_canzona.rules.newton_schulz.symmetric_product` its static blocks, and
  `lightning_canzona.geometry.split_sizes` its ``divmod`` of plain integers);
- with inductor's ``emulate_precision_casts``: a bf16 intermediate is rounded to bf16 where eager
  rounds it, not kept in float32 inside a fused kernel, so that compiled and eager results agree
  bit for bit in bf16 as in float32 (`tests/unit/test_compiled.py`);
- allowed `GRAPHS` graphs: dynamo's default, 8 per function, is fewer than a model's shapes.

What stays eager, and why:

- A team's Newton–Schulz (`lightning_canzona.rules.newton_schulz.team_newton_schulz`) is a
  generator that hands each round's partial Gram matrix to the team's collectives: no graph can
  hold more than the local pieces between two rounds, and each is one fused product already
  (``addmm``/``baddbmm``), which inductor hands to the same BLAS call.
- The elementwise updates (Muon's momentum and step into the weights, AdamW, stochastic
  rounding): compiled with the same options on this machine (torch 2.13, CPU), they were not
  bit for bit eager's — the momentum's ``lerp``, the step and AdamW's moments differed by one
  float32 ulp (up to 1.2e-7 after three steps) and by up to 3 bf16 ulps, inductor's fused
  kernels rounding other than the ``torch._foreach_*`` kernels — and dynamo specialised on the
  learning rate, a Python number (one graph per value: a recompile every step under a
  scheduler). Eager, they are one foreach kernel per operation for a whole param group.

``"auto"`` (the default) compiles on CUDA and runs eager elsewhere, from the measurements in
``docs/optimizers.md`` (Compiled Newton–Schulz): on this machine's CPU the compiled steps gained
no more than the noise per step (their work is the same BLAS products), while the first step
paid 10–30 s; on a GPU the elementwise work between the products, fused, and fewer kernel
launches are what dion and torchtitan compile their Newton–Schulz for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal, TypeVar

import torch

from lightning_canzona.compat import compile_function

#: The values the ``compile`` setting takes.
COMPILE_CHOICES = (True, False, "auto")
Compile = bool | Literal["auto"]
#: Graphs that the compiled function may hold (one per shape, dtype and form; a stack's count
#: of matrices is part of its shape) before dynamo would stop compiling it (raise, under
#: ``fullgraph=True``).
GRAPHS = 256

Function = TypeVar("Function", bound=Callable[..., object])


def check_compile(value: object) -> Compile:
    """``value`` if it is a ``compile`` setting, else a `ValueError` naming the setting."""
    if value not in COMPILE_CHOICES or not isinstance(value, (bool, str)):
        raise ValueError(f"compile must be True, False or 'auto', got {value!r}")
    return value  # type: ignore[return-value]


def compiles(setting: Compile, device: torch.device) -> bool:
    """Whether ``setting`` compiles the rules' functions for tensors on ``device``: ``"auto"``
    on CUDA only (see the module docstring)."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


@functools.cache
def compiled(function: Function) -> Function:
    """``function`` compiled once for the process (see the module docstring for how)."""
    options = {"emulate_precision_casts": True}
    return compile_function(function, GRAPHS, fullgraph=True, dynamic=False, options=options)
