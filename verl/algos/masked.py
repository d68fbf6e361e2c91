"""Masked reductions that never divide by zero and never let masked-out values leak.

Departures from the reference verl (``verl.utils.torch_functional``), all on inputs where the
reference yields NaN or raises, identical elsewhere (to float32 rounding):

- masked entries are selected with ``torch.where`` instead of multiplied by the mask, so a
  ``-inf`` log-prob or a NaN in a padded position cannot turn the sum into NaN (``-inf * 0``);
- the mean of an all-masked row (or tensor) is 0, not NaN: the denominator is the mask count
  clamped to at least 1 (the reference adds 1e-8, which equals this for any count >= 1 in
  float32 and also gives 0 for an empty mask when the masked values are finite);
- ``masked_var`` with fewer than two valid entries (unbiased) returns 0 instead of raising, so
  ``masked_whiten`` maps a lone valid entry to 0 instead of failing the step.
"""

from __future__ import annotations

import torch


def _as_weights(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if mask.shape != values.shape:
        mask = mask.expand_as(values)
    return mask.to(values.dtype)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values * mask`` over ``dim`` (all dims if None); masked entries contribute exactly 0.

    values, mask: same shape (e.g. [B, T]); the mask may be bool, int or float (weights).
    """
    w = _as_weights(values, mask)
    picked = torch.where(w != 0, values * w, torch.zeros((), dtype=values.dtype, device=values.device))
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_count(mask: torch.Tensor, dim: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sum of the mask (the number of valid entries for a 0/1 mask) over ``dim``."""
    m = mask.to(dtype)
    return m.sum() if dim is None else m.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of the valid entries over ``dim``; 0 where nothing is valid.

    values, mask: e.g. [B, T]; ``dim=-1`` gives [B] per-row means, ``dim=None`` a scalar.
    """
    total = masked_sum(values, mask, dim)
    count = masked_count(_as_weights(values, mask), dim, dtype=values.dtype)
    return total / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of all valid entries (a scalar), with Bessel's correction when ``unbiased``.

    Returns 0 when there are too few valid entries for the estimate (0, or 1 when unbiased).
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = masked_count(_as_weights(values, mask), dtype=values.dtype)
        var = torch.where(n > 1, var * n / (n - 1).clamp(min=1), torch.zeros_like(var))
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) with mean and unbiased var over the valid entries.

    values, mask: [B, T] (any shape works; statistics are over all valid entries together).
    With ``shift_mean=False`` the mean is added back (scale only). Entries where the mask is 0
    are transformed too (as in the reference); callers that need zeros there multiply by the mask.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened
