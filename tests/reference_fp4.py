"""Independent oracle for coat's block-scaled FP4 (E2M1) codec, in plain PyTorch float64, written from the
format definition in csrc/include/coat/fp4.h and quantize.h (not from the C code).

E2M1 magnitudes are the grid 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0..7, sign in bit 3). The encoder here picks
the grid point nearest to |y| by measuring the distance to all eight (exact in float64 once |y| is clamped
to 6, which is also the saturation rule), ties going to the even code; the C core instead counts the
midpoints |y| passes. Scales and quotients are fp32 values computed in float64 and rounded once, which is
the fp32 operation itself (see reference.py's docstring).

Rules the oracle encodes: scale = max(fp32(amax / 6), 2^-126) per 1 x B block, NaN for a block holding a
NaN; code = e2m1(fp32(x / scale)) with a NaN quotient (NaN scale, or Inf / Inf) encoding a zero of x's sign;
value = fp32(decode(code) * scale). Codes are packed low nibble first, rows padded to whole bytes with 0.
"""
from __future__ import annotations

import torch

from reference import MIN_SCALE, num_groups, sign_bit

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
E2M1_MAX = 6.0


def encode(y: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (one per element, 0..15) of float32 values."""
    assert y.dtype == torch.float32
    magnitude = y.to(torch.float64).abs().clamp(max=E2M1_MAX)  # saturation; Inf too
    distance = (magnitude.unsqueeze(-1) - E2M1_VALUES).abs()
    nearest = distance == distance.min(dim=-1, keepdim=True).values
    even = torch.arange(8) % 2 == 0
    nearest_even = nearest & even
    # a tie has one even candidate, which wins; otherwise the only candidate
    index = torch.where(nearest_even.any(dim=-1), nearest_even.int().argmax(dim=-1), nearest.int().argmax(dim=-1))
    index = torch.where(torch.isnan(y), 0, index)  # no NaN in E2M1: a zero
    return (index + torch.where(sign_bit(y), 8, 0)).to(torch.uint8)


def decode(codes: torch.Tensor) -> torch.Tensor:
    """float64 values of unpacked codes (0..15)."""
    codes = codes.long()
    return torch.where(codes >= 8, -1.0, 1.0).to(torch.float64) * E2M1_VALUES[codes & 7]


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Unpacked codes [..., cols] to bytes [..., ceil(cols / 2)]: element 2i low nibble, 2i+1 high, 0 padding."""
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor, cols: int) -> torch.Tensor:
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)[..., :cols]


def expand_blocks(per_block: torch.Tensor, cols: int, block_size: int) -> torch.Tensor:
    return per_block.repeat_interleave(block_size, dim=-1)[..., :cols]


def block_scales(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """float32 scales [..., ceil(cols / B)]: max(fp32(amax / 6), 2^-126), NaN where the block holds a NaN."""
    cols = x.shape[-1]
    nblocks = num_groups(cols, block_size)
    x64 = torch.nn.functional.pad(x.to(torch.float64), (0, nblocks * block_size - cols))
    blocks = x64.reshape(*x.shape[:-1], nblocks, block_size)
    amax = torch.nan_to_num(blocks.abs(), nan=0.0, posinf=float("inf")).amax(dim=-1)
    scale = torch.maximum((amax / E2M1_MAX).to(torch.float32), torch.tensor(MIN_SCALE, dtype=torch.float32))
    return torch.where(torch.isnan(blocks).any(dim=-1), torch.tensor(float("nan")), scale)


def quantize_fp4(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 codes [..., ceil(cols / 2)], float32 scales [..., ceil(cols / B)])."""
    scales = block_scales(x, block_size)
    per_element = expand_blocks(scales, x.shape[-1], block_size).to(torch.float64)
    quotient = (x.to(torch.float64) / per_element).to(torch.float32)
    codes = encode(quotient)
    # a NaN quotient takes x's sign (its own sign is the platform's choice)
    codes = torch.where(torch.isnan(quotient), torch.where(sign_bit(x), 8, 0).to(torch.uint8), codes)
    return pack(codes), scales


def dequantize_fp4(packed: torch.Tensor, scales: torch.Tensor, cols: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    values = decode(unpack(packed, cols)) * expand_blocks(scales, cols, block_size).to(torch.float64)
    return values.to(torch.float32).to(dtype)


def fp4_to_e4m3(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """uint8 E4M3 codes of the same values, through torch's own (exact, for these values) E4M3 conversion."""
    return decode(unpack(packed, cols)).to(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)
