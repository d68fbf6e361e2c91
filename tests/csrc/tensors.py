"""What the csrc kernel tests share: the dtypes and devices they cover, random tensors, bytes
views, and the check that a refused call raised the expected error and wrote nothing.

Copies are exact, so every comparison is bitwise (tensors viewed as bytes), which also makes
NaN payloads and float8 values comparable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from verl.hybrid.range_checks import extension_has_cuda

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
] + [getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)]

HAS_CUDA = torch.cuda.is_available() and extension_has_cuda()
NEEDS_CUDA = pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU and verl._C built with CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)]


def random_tensor(
    dtype: torch.dtype, shape: int | Sequence[int], gen: torch.Generator, device: str = "cpu"
) -> torch.Tensor:
    """A contiguous tensor of random bytes; bools hold only 0/1 so they stay valid."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    numel = 1
    for size in shape:
        numel *= size
    high = 2 if dtype == torch.bool else 256
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, high, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape).to(device)


def random_flat(dtype: torch.dtype, numel: int, gen: torch.Generator, device: str = "cpu") -> torch.Tensor:
    """A flat tensor of random bytes ([numel])."""
    return random_tensor(dtype, numel, gen, device)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes on the host, flat ([nbytes] uint8)."""
    return t.detach().cpu().reshape(-1).view(torch.uint8)


def assert_rejected(call: Callable[[], object], tensors: Sequence[torch.Tensor], match: str) -> str:
    """``call()`` raises ValueError matching ``match`` and leaves every tensor byte-for-byte as
    it was; returns the message."""
    before = [as_bytes(t).clone() for t in tensors]
    with pytest.raises(ValueError, match=match) as info:
        call()
    for k, (t, old) in enumerate(zip(tensors, before)):
        assert torch.equal(as_bytes(t), old), f"tensor {k} was written by a refused call"
    return str(info.value)
