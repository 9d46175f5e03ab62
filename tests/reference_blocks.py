"""Independent oracle for coat's block-scaled FP4 (E2M1) and FP6 (E2M3, OCP MX) codecs, in plain PyTorch float64,
written from the format definitions in csrc/include/coat/fp4.h, fp6.h and quantize.h (not from the C code).

The two formats follow one set of rules and differ only in their grid of magnitudes, their code width and their
packing, which BlockFormat holds:
  E2M1 (fp4): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0..7, sign in bit 3), largest 6; two codes per byte,
              element 2i of a row in the low nibble of byte i, 2i+1 in the high nibble, ceil(cols / 2) bytes.
  E2M3 (fp6): magnitudes 0 .. 1.875 in steps of 1/8, 2 .. 3.75 in steps of 1/4, 4 .. 7.5 in steps of 1/2 (codes
              0..31, sign in bit 5), largest 7.5; four codes per three bytes, element 4i+j in bits 6j..6j+5 of the
              little-endian 24-bit word of bytes 3i..3i+2, ceil(3 cols / 4) bytes, the bits past the last code 0.
Both grids are listed here as values (the spec tables), not built from exponent and mantissa bits; a code's
magnitude bits are its index in the ascending grid. The encoder picks the grid point nearest to |y| by measuring
the distance to every grid point (exact in float64 once |y| is clamped to the largest value, which is also the
saturation rule), ties going to the even code; the C core instead computes the code arithmetically. Scales and
reciprocals are fp32 values computed in float64 and rounded once, which is the fp32 operation itself (see
reference.py's docstring); the product of x and the reciprocal is exact in float64 (two 24-bit significands).

Rules the oracle encodes: scale = max(fp32(amax / E_MAX), 2^-126) per 1 x B block, NaN for a block holding a NaN;
code = encode(x * fp32(1 / scale)), the product exact, not rounded to fp32, with a NaN product (NaN scale, or Inf
times the 0 reciprocal of an Inf scale) encoding a zero of x's sign; value = fp32(decode(code) * scale).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from reference import MIN_SCALE, num_groups, sign_bit


@dataclass(frozen=True)
class BlockFormat:
    name: str  # coat's name for it: "fp4" or "fp6"
    grid: tuple[float, ...]  # the magnitudes, ascending; a magnitude code is its index
    code_bits: int  # bits per code, the sign the top one
    codes_per_word: int  # codes packed into one little-endian word of word_bytes bytes
    word_bytes: int

    @property
    def values(self) -> torch.Tensor:
        return torch.tensor(self.grid, dtype=torch.float64)

    @property
    def max(self) -> float:  # E_MAX, the largest magnitude
        return self.grid[-1]

    @property
    def sign(self) -> int:  # the sign bit of a code
        return 1 << (self.code_bits - 1)

    @property
    def max_code(self) -> int:  # the code of +E_MAX; -E_MAX is max_code | sign
        return len(self.grid) - 1

    def row_bytes(self, cols: int) -> int:
        """Bytes of a packed row of cols codes: ceil(cols * code_bits / 8)."""
        return -(-cols * self.code_bits // 8)


E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M3_GRID = (tuple(i / 8 for i in range(16))  # 0 .. 1.875, the subnormals below 1
             + tuple(2 + i / 4 for i in range(8))  # 2 .. 3.75
             + tuple(4 + i / 2 for i in range(8)))  # 4 .. 7.5

FP4 = BlockFormat("fp4", E2M1_GRID, code_bits=4, codes_per_word=2, word_bytes=1)
FP6 = BlockFormat("fp6", E2M3_GRID, code_bits=6, codes_per_word=4, word_bytes=3)
FORMATS = {"fp4": FP4, "fp6": FP6}


def block_format(fmt: str | BlockFormat) -> BlockFormat:
    return fmt if isinstance(fmt, BlockFormat) else FORMATS[fmt]


def encode(y: torch.Tensor, fmt) -> torch.Tensor:
    """uint8 codes (one per element, unpacked) of float32 values, or of exact float64 products."""
    fmt = block_format(fmt)
    assert y.dtype in (torch.float32, torch.float64)
    magnitude = y.to(torch.float64).abs().clamp(max=fmt.max)  # saturation; Inf too
    distance = (magnitude.unsqueeze(-1) - fmt.values).abs()
    nearest = distance == distance.min(dim=-1, keepdim=True).values
    even = torch.arange(len(fmt.grid)) % 2 == 0
    nearest_even = nearest & even
    # a tie has one even candidate, which wins; otherwise the only candidate
    index = torch.where(nearest_even.any(dim=-1), nearest_even.int().argmax(dim=-1), nearest.int().argmax(dim=-1))
    index = torch.where(torch.isnan(y), 0, index)  # no NaN in either format: a zero
    return (index + torch.where(sign_bit(y), fmt.sign, 0)).to(torch.uint8)


def decode(codes: torch.Tensor, fmt) -> torch.Tensor:
    """float64 values of unpacked codes."""
    fmt = block_format(fmt)
    codes = codes.long()
    return torch.where(codes & fmt.sign != 0, -1.0, 1.0).to(torch.float64) * fmt.values[codes & (fmt.sign - 1)]


def pack(codes: torch.Tensor, fmt) -> torch.Tensor:
    """Unpacked codes [..., cols] to bytes [..., row_bytes(cols)]: codes_per_word codes to a little-endian word of
    word_bytes bytes, the first code in the lowest bits; the row padded with 0 bits."""
    fmt = block_format(fmt)
    cols = codes.shape[-1]
    n = fmt.codes_per_word
    padded = torch.nn.functional.pad(codes.long(), (0, -cols % n))
    groups = padded.reshape(*codes.shape[:-1], padded.shape[-1] // n, n)
    word = sum(groups[..., j] << (fmt.code_bits * j) for j in range(n))
    packed = torch.stack([(word >> (8 * k)) & 0xFF for k in range(fmt.word_bytes)], dim=-1).flatten(-2)
    return packed[..., : fmt.row_bytes(cols)].to(torch.uint8)


def unpack(packed: torch.Tensor, cols: int, fmt) -> torch.Tensor:
    """Bytes [..., row_bytes(cols)] to unpacked uint8 codes [..., cols]."""
    fmt = block_format(fmt)
    assert packed.shape[-1] == fmt.row_bytes(cols)
    padded = torch.nn.functional.pad(packed.long(), (0, -packed.shape[-1] % fmt.word_bytes))
    groups = padded.reshape(*packed.shape[:-1], padded.shape[-1] // fmt.word_bytes, fmt.word_bytes)
    word = sum(groups[..., k] << (8 * k) for k in range(fmt.word_bytes))
    mask = (1 << fmt.code_bits) - 1
    codes = torch.stack([(word >> (fmt.code_bits * j)) & mask for j in range(fmt.codes_per_word)], dim=-1)
    return codes.flatten(-2)[..., :cols].to(torch.uint8)


def expand_blocks(per_block: torch.Tensor, cols: int, block_size: int) -> torch.Tensor:
    return per_block.repeat_interleave(block_size, dim=-1)[..., :cols]


def block_scales(x: torch.Tensor, fmt, block_size: int) -> torch.Tensor:
    """float32 scales [..., ceil(cols / B)]: max(fp32(amax / E_MAX), 2^-126), NaN where the block holds a NaN."""
    fmt = block_format(fmt)
    cols = x.shape[-1]
    nblocks = num_groups(cols, block_size)
    x64 = torch.nn.functional.pad(x.to(torch.float64), (0, nblocks * block_size - cols))
    blocks = x64.reshape(*x.shape[:-1], nblocks, block_size)
    amax = torch.nan_to_num(blocks.abs(), nan=0.0, posinf=float("inf")).amax(dim=-1)
    scale = torch.maximum((amax / fmt.max).to(torch.float32), torch.tensor(MIN_SCALE, dtype=torch.float32))
    return torch.where(torch.isnan(blocks).any(dim=-1), torch.tensor(float("nan")), scale)


def quantize(x: torch.Tensor, fmt, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 codes [..., row_bytes(cols)], float32 scales [..., ceil(cols / B)])."""
    fmt = block_format(fmt)
    scales = block_scales(x, fmt, block_size)
    reciprocals = (1.0 / expand_blocks(scales, x.shape[-1], block_size).to(torch.float64)).to(torch.float32)
    product = x.to(torch.float64) * reciprocals.to(torch.float64)
    codes = encode(product, fmt)
    # a NaN product takes x's sign (its own sign is the platform's choice)
    codes = torch.where(torch.isnan(product), torch.where(sign_bit(x), fmt.sign, 0).to(torch.uint8), codes)
    return pack(codes, fmt), scales


def dequantize(packed: torch.Tensor, scales: torch.Tensor, cols: int, fmt, block_size: int,
               dtype: torch.dtype) -> torch.Tensor:
    values = decode(unpack(packed, cols, fmt), fmt) * expand_blocks(scales, cols, block_size).to(torch.float64)
    return values.to(torch.float32).to(dtype)


def to_e4m3(packed: torch.Tensor, cols: int, fmt) -> torch.Tensor:
    """uint8 E4M3 codes of the same values, through torch's own (exact, for these values) E4M3 conversion."""
    return decode(unpack(packed, cols, fmt), fmt).to(torch.float32).to(torch.float8_e4m3fn).view(torch.uint8)
