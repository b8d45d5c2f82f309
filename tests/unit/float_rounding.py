"""How far float32 results may honestly stray, for tests that compare two computations of the same value.

Two correct float32 computations that sum in different orders (another BLAS kernel, another chunk shape,
another CPU) may round differently; comparing them exactly pins one machine's numbers. These bounds are
the worst case that IEEE rounding allows, so a test asserting them holds on every CPU and still fails on
any error larger than rounding (a wrong row, column, position or layer is off by far more).
"""

from __future__ import annotations

import torch

# float32's unit roundoff: one rounding moves a value by at most this fraction of it.
U32 = 2.0**-24


def dot_error_bound(rows: torch.Tensor, weight: torch.Tensor, unit: float = U32) -> torch.Tensor:
    """[N, V] float64: how far ``rows @ weight.T`` computed with roundoff ``unit`` may be from the exact
    products of the same inputs, in any summation order and blocking.

    Higham's bound for a sum of n products: gamma_n * sum_i |x_i w_i|, gamma_n = n u / (1 - n u).
    Two such computations differ by at most twice it.
    """
    n = rows.shape[-1]
    gamma = n * unit / (1 - n * unit)
    return gamma * (rows.double().abs() @ weight.double().abs().T)
