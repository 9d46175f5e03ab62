"""Tests of the fused non-linear layers: coat.ops.rmsnorm_quantize / rmsnorm_backward / rmsnorm_requantize
and silu_mul_quantize / silu_mul_backward / silu_mul_requantize (csrc/include/coat/norm_act.h), the latter with
either activation (silu: SwiGLU; gelu_tanh: GeGLU), each SiLU*mul test taking both where it has `activation`.

What is checked, and against what:
- Ties to the standalone quantizers, bit for bit: y == quantize_tensor(the fp32 op result), and the saved
  inputs == quantize_group(input). A NaN that the op's arithmetic produces is made canonical (positive)
  before it is quantized, since its sign is platform-defined; the fp32 replay of the op does not know
  that, so y's NaN codes are compared without their sign. Saved inputs come from memory and keep it.
- The documented arithmetic, bit for bit: rstd, dx, dweight, dgate and dup equal an fp32 replay
  (tests/reference_norm_act.py) of the operation and reduction order norm_act_math.h documents.
- Accuracy against float64 references written from the formulas:
  * y is FP8, so the bf16 rule cannot apply to it. Bound: y / y_scale lies within half an FP8 step of the
    exact value (round to nearest) plus a relative slack of 1e-5 for the fp32 arithmetic before rounding
    (the fp32 error of the op is below 3e-6), so a code may differ from the exact rounding only where the
    exact value is that close to a rounding boundary; y_scale is within 1e-5 of amax(y64) / FP8_MAX.
  * The backward reads FP8-saved inputs, so against the float64 gradient at the exact input its error is
    FP8 noise, not arithmetic. Bound: the reference is the float64 backward evaluated at the dequantized
    saved inputs (and the kernel's rstd), and the flash-attention rule applies there: max error at most
    2x that of the same formula computed by PyTorch in bf16.
  * rstd: the flash-attention rule against float64, and the tighter fp32 bound derived in
    test_rmsnorm_forward.
- Requantize: bit for bit against an fp32 replay, and against the forward's y_t (see its section).
- rmsnorm_backward with a residual gradient: dx equals the op's dx without one, .to(residual.dtype) + residual
  (torch's add), bit for bit, with every NaN canonical.
- CUDA (skipped without a GPU): every output equal to the C core's, bit for bit.
"""
from __future__ import annotations

import math

import pytest
import torch

import reference_norm_act as ref
from coat import ops

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-6
BLOCK_FORMATS = ("fp4", "fp6")  # the packed, block-scaled saved formats
ACTIVATIONS = ops.ACTIVATIONS


# ----------------------------------------------------------------------------------------------------
# helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as integers, so that comparisons are exact (NaN included)."""
    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.view(integer)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    differ = bits(actual.cpu()) != bits(expected.cpu())
    if differ.any():
        first = differ.nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int(differ.sum())} of {differ.numel()} elements differ, first at {first}")


def nan_codes_unsigned(codes: torch.Tensor) -> torch.Tensor:
    """FP8 codes with the sign of NaN codes cleared (NaN is S.1111.111 in E4M3 and S.11111.11 in E5M2)."""
    raw = codes.view(torch.uint8)
    return torch.where((raw & 0x7F) == 0x7F, torch.full_like(raw, 0x7F), raw).view(codes.dtype)


def on_device(t: torch.Tensor | None, device: str) -> torch.Tensor | None:
    """t on `device` with the same sizes, strides and storage offset, so that views stay views."""
    if t is None or device == "cpu":
        return t
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=t.dtype).set_(storage, 0, (storage.nbytes() // t.element_size(),), (1,))
    return flat.to(device).as_strided(t.shape, t.stride(), t.storage_offset())


def run(op, *args, device: str):
    """Runs the op on `device` (args are CPU tensors and scalars) and returns CPU outputs. On CUDA it also
    runs the C core and requires every output to be the same, bit for bit."""
    outputs = op(*(on_device(a, device) if isinstance(a, torch.Tensor) else a for a in args))
    if device != "cpu":
        for i, (gpu, cpu) in enumerate(zip(outputs, op(*args))):
            assert_same_bits(gpu.cpu(), cpu, f"output {i} on {device} vs the C core")
    return tuple(t.cpu() for t in outputs)


def activations(shape, dtype, seed: int, outliers: bool = True) -> torch.Tensor:
    """Normal values with heavy-tailed per-row and per-channel magnitudes, like LLM activations."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if outliers:
        x = x * torch.exp(torch.randn(shape[-1], generator=g, dtype=torch.float64))
        x = x * torch.exp(0.5 * torch.randn(*shape[:-1], 1, generator=g, dtype=torch.float64))
    return x.to(dtype)


def max_error(actual: torch.Tensor, expected64: torch.Tensor) -> float:
    return (actual.double() - expected64).abs().max().item() if actual.numel() else 0.0


def check_fp8_output(y: torch.Tensor, y_scale: torch.Tensor, y64: torch.Tensor) -> None:
    """The FP8 accuracy bound stated in the module docstring."""
    fp8 = y.dtype
    expected_scale = ref.per_tensor_scale(y64, fp8)
    assert y_scale.shape == () and y_scale.dtype == torch.float32
    assert abs(y_scale.item() - expected_scale) <= 1e-5 * expected_scale
    exact = (y64 / y_scale.double()).flatten()
    finite = torch.isfinite(exact)
    error = (y.double().flatten() - exact).abs()[finite]
    allowed = 0.5 * ref.fp8_step(exact, fp8)[finite] + 1e-5 * exact.abs()[finite]
    assert (error <= allowed).all(), f"max excess {(error - allowed).max().item()}"


def check_tied_to_quantize_tensor(y, y_scale, y32, y_t) -> None:
    """y_t is the op's transpose output, empty when it was not asked for."""
    transpose_output = y_t if y_t.numel() == y.numel() else None
    q, scale, q_t = ops.quantize_tensor(y32, y.dtype, transpose=transpose_output is not None)
    assert_same_bits(y_scale, scale, "y_scale vs quantize_tensor")
    assert_same_bits(y, nan_codes_unsigned(q), "y vs quantize_tensor")
    if transpose_output is not None:
        assert_same_bits(transpose_output, nan_codes_unsigned(q_t), "y_t vs quantize_tensor")


def check_tied_to_quantize_group(saved, scales, x, group_size) -> None:
    q, expected_scales, _ = ops.quantize_group(x, group_size, E4M3)
    assert_same_bits(scales, expected_scales, "saved scales vs quantize_group")
    assert_same_bits(saved, q, "saved codes vs quantize_group")


def rows_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def rmsnorm_forward(x, weight, *, eps=EPS, group_size=16, amax_group_size=128, fp8=E4M3, transpose=True, device="cpu",
                    save_format="e4m3"):
    return run(torch.ops.coat.rmsnorm_quantize, x, weight, eps, group_size, amax_group_size, fp8, transpose,
               save_format, device=device)


def silu_mul_forward(gate, up, smooth=None, *, group_size=16, fp8=E4M3, transpose=True, device="cpu",
                     save_format="e4m3", activation="silu"):
    return run(torch.ops.coat.silu_mul_quantize, gate, up, smooth, group_size, 128, fp8, transpose,
               save_format, activation, device=device)


# ----------------------------------------------------------------------------------------------------
# RMSNorm forward

# H in {64, 128, 2048, 11008} from Llama shapes, 176 and 1000 (H % 128 != 0), 100 and 7 (H % 8 != 0: short
# chunks and the CUDA scalar path); rows 1, 97, 4097.
RMSNORM_SHAPES = [(1, 64), (97, 128), (4097, 176), (97, 2048), (1, 11008), (97, 11008), (97, 1000), (5, 100), (3, 7)]
# (x dtype, weight dtype, save group size, FP8 format of y)
RMSNORM_OPTIONS = [
    (torch.float32, torch.float32, 32, E4M3),
    (torch.float16, torch.bfloat16, 64, E5M2),
    (torch.bfloat16, torch.float32, 128, E5M2),
    (torch.bfloat16, torch.float16, 16, E4M3),
]


def check_rmsnorm_forward(x, weight, outputs, *, eps=EPS, group_size=16) -> None:
    y, y_scale, y_t, x_saved, x_saved_scales, rstd = outputs
    cols = x.shape[-1]
    x32, w32 = rows_of(x).float(), weight.float()

    # rstd: the documented order, bit for bit, then its accuracy. The fp32 bound: each lane adds at most
    # 8 * 4 terms and the tree log2(L) more, every addition of positive terms costing one rounding u = 2^-24
    # relatively; mean, + eps, sqrt (which halves the relative error) and the division add about 2u.
    # 4 extra units and a factor of 2 of margin give the bound below.
    assert rstd.shape == (x32.shape[0],) and rstd.dtype == torch.float32
    assert_same_bits(rstd, ref.rmsnorm_rstd_f32(x32, eps), "rstd vs the documented order")
    y64, rstd64 = ref.rmsnorm(rows_of(x), weight, eps)
    rstd_bf16 = torch.rsqrt(rows_of(x).bfloat16().pow(2).mean(dim=-1) + eps)
    assert max_error(rstd, rstd64) <= 2 * max_error(rstd_bf16, rstd64)
    lanes = ref.rmsnorm_lanes(cols)
    bound = (8 * ref.MAX_CHUNKS_PER_LANE + math.log2(lanes) + 4) * 2.0**-24
    assert ((rstd.double() - rstd64).abs() / rstd64).max().item() <= bound

    # y: tied to quantize_tensor of the fp32 result computed with the kernel's rstd, then its accuracy
    y32 = ref.rmsnorm_forward_f32(x32, rstd, w32).reshape(x.shape)
    check_tied_to_quantize_tensor(y, y_scale, y32, y_t)
    check_fp8_output(y, y_scale, y64.reshape(x.shape))
    assert_same_bits(y_t, rows_of(y).T.contiguous(), "y_t vs y")

    check_tied_to_quantize_group(x_saved, x_saved_scales, x, group_size)


@pytest.mark.parametrize("shape", RMSNORM_SHAPES, ids=str)
def test_rmsnorm_forward(device, shape):
    x = activations(shape, torch.bfloat16, seed=shape[0] * shape[1])
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=torch.Generator().manual_seed(1))).bfloat16()
    check_rmsnorm_forward(x, weight, rmsnorm_forward(x, weight, device=device))


@pytest.mark.parametrize("x_dtype, weight_dtype, group_size, fp8", RMSNORM_OPTIONS, ids=str)
def test_rmsnorm_forward_dtypes_and_groups(device, x_dtype, weight_dtype, group_size, fp8):
    x = activations((33, 1000), x_dtype, seed=7)
    weight = (1 + 0.2 * torch.randn(1000, generator=torch.Generator().manual_seed(2))).to(weight_dtype)
    outputs = rmsnorm_forward(x, weight, eps=1e-5, group_size=group_size, fp8=fp8, device=device)
    assert outputs[0].dtype == fp8
    check_rmsnorm_forward(x, weight, outputs, eps=1e-5, group_size=group_size)


def test_rmsnorm_forward_nd_and_strided(device):
    base = activations((2, 3, 5, 300), torch.bfloat16, seed=3)
    weight = torch.rand(256).bfloat16() + 0.5
    for x in (base[..., :256], base[..., 5:261]):  # row-strided; the second is not 16-byte aligned
        outputs = rmsnorm_forward(x, weight, device=device)
        y, y_scale, y_t, x_saved, x_saved_scales, rstd = outputs
        assert y.shape == x.shape and y_t.shape == (256, 30) and x_saved.shape == x.shape
        assert x_saved_scales.shape == (2, 3, 5, 16) and rstd.shape == (30,)
        check_rmsnorm_forward(x, weight, outputs)
        flat = rmsnorm_forward(rows_of(x.contiguous()), weight)
        for nd, two_d in zip(outputs, flat):
            assert_same_bits(nd.reshape(two_d.shape), two_d, "N-D strided vs 2-D contiguous")


def test_rmsnorm_forward_without_transpose(device):
    x = activations((97, 128), torch.bfloat16, seed=4)
    weight = torch.ones(128, dtype=torch.bfloat16)
    with_t = rmsnorm_forward(x, weight, device=device)
    without = rmsnorm_forward(x, weight, transpose=False, device=device)
    assert without[2].numel() == 0
    for i in (0, 1, 3, 4, 5):
        assert_same_bits(without[i], with_t[i])
    y, y_scale, y_t, *_ = ops.rmsnorm_quantize(x, weight)
    assert y_t is None


# Widths with whole chunks, a short chunk (1000 % 16 == 8), rows that end inside a packed byte (FP4: the odd widths 7
# and 13) or inside a packed three-byte word (FP6: 13, 50 and 7 leave 1, 2 and 3 codes in the last word), one
# narrower than a chunk; group sizes 16 to 128.
# G = 64 and 128 with rows cut inside a group: SiLU*mul's backward shares FP4 gates' factors across those groups
BLOCK_SAVE_CASES = [((97, 2048), 16), ((33, 1000), 128), ((5, 100), 16), ((3, 7), 16), ((4097, 176), 32),
                    ((9, 50), 32), ((4, 13), 16), ((9, 300), 128), ((6, 1100), 64)]


@pytest.mark.parametrize("shape, group_size", BLOCK_SAVE_CASES, ids=str)
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_rmsnorm_forward_saves_fp4_and_fp6(device, fmt, shape, group_size):
    """save_format 1 (FP4) or 2 (FP6): x kept as quantize_blocks(x, fmt, G) bit for bit, made in the same pass;
    every other output as with E4M3. Specials (NaN, Inf, zeros, tiny values) go through the block rule."""
    x = activations(shape, torch.bfloat16, seed=shape[1])
    x[0, : min(3, shape[1])] = torch.tensor([float("nan"), 0.0, 1e-30][: min(3, shape[1])], dtype=torch.bfloat16)
    if shape[0] > 1:
        x[1, -1] = float("inf")
    weight = (1 + 0.2 * torch.randn(shape[1], generator=torch.Generator().manual_seed(1))).bfloat16()
    packed = rmsnorm_forward(x, weight, group_size=group_size, device=device, save_format=fmt)
    e4m3 = rmsnorm_forward(x, weight, group_size=group_size, device=device)
    codes, scales = ops.quantize_blocks(x, fmt, group_size)
    assert_same_bits(packed[3], codes, f"x_saved vs quantize_blocks {fmt}")
    assert_same_bits(packed[4], scales, f"x_saved_scales vs quantize_blocks {fmt}")
    for i in (0, 1, 2, 5):
        assert_same_bits(packed[i], e4m3[i], "an output other than the saved copy")


def test_rmsnorm_amax_group_size_does_not_change_outputs(device):
    x = activations((33, 176), torch.bfloat16, seed=5)
    weight = torch.ones(176, dtype=torch.bfloat16)
    first = rmsnorm_forward(x, weight, amax_group_size=16, device=device)
    for amax_group_size in (32, 64, 128):
        for a, b in zip(first, rmsnorm_forward(x, weight, amax_group_size=amax_group_size, device=device)):
            assert_same_bits(a, b)


def test_rmsnorm_forward_special_values(device):
    """Zero and constant rows, NaN and +-Inf. Documented behaviour: a zero row gives y = 0 and
    rstd = 1/sqrt(eps); a NaN row gives rstd = NaN and NaN codes in its y row; a row holding +-Inf gets
    rstd = 0, so y is 0 there except NaN (Inf * 0) at the Inf; NaN rows never reach y_scale (NaN is
    ignored by the amax); the saved input follows quantize_group (an Inf makes its group's scale Inf)."""
    x = activations((6, 64), torch.bfloat16, seed=6, outliers=False)
    x[0] = 0
    x[1] = 3.0
    x[2, 5] = math.nan
    x[3, 7] = math.inf
    x[4, 9] = -math.inf
    weight = torch.ones(64, dtype=torch.bfloat16)
    outputs = rmsnorm_forward(x, weight, device=device)
    y, y_scale, y_t, x_saved, x_saved_scales, rstd = outputs
    codes = y.view(torch.uint8)
    assert (codes[0] == 0).all() and rstd[0].item() == pytest.approx(1 / math.sqrt(EPS), rel=1e-6)
    assert rstd[1].item() == pytest.approx(1 / math.sqrt(9 + EPS), rel=1e-6)
    assert torch.isnan(rstd[2]) and (codes[2] == 0x7F).all()
    for row, col in ((3, 7), (4, 9)):
        assert rstd[row].item() == 0.0
        expected = torch.zeros(64, dtype=torch.uint8)
        expected[col] = 0x7F
        assert torch.equal(codes[row] & 0x7F, expected)  # x * 0 keeps the sign of x: codes 0x00 and 0x80
    finite_rows = ref.rmsnorm(x[[0, 1, 5]], weight, EPS)[0]
    assert y_scale.item() == pytest.approx(ref.per_tensor_scale(finite_rows, E4M3), rel=1e-5)
    check_tied_to_quantize_group(x_saved, x_saved_scales, x, 16)
    check_tied_to_quantize_tensor(y, y_scale, ref.rmsnorm_forward_f32(x.float(), rstd, weight.float()), y_t)


# ----------------------------------------------------------------------------------------------------
# RMSNorm backward


def rmsnorm_backward_case(shape, dtype, weight_dtype=torch.bfloat16, group_size=16, seed=0):
    x = activations(shape, torch.bfloat16, seed=seed)
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=torch.Generator().manual_seed(seed + 1))).to(weight_dtype)
    _, _, _, x_saved, x_saved_scales, rstd = rmsnorm_forward(x, weight, group_size=group_size, transpose=False)
    dy = activations(shape, dtype, seed=seed + 2, outliers=False)
    return dy, x_saved, x_saved_scales, rstd, weight


def check_rmsnorm_backward(dy, x_saved, x_saved_scales, rstd, weight, group_size, dx, dweight) -> None:
    x_deq = rows_of(ops.dequantize(x_saved, x_saved_scales, group_size, torch.float32))
    dy32, w32 = rows_of(dy).float(), weight.float()
    dx32, dweight32 = ref.rmsnorm_backward_f32(dy32, x_deq, rstd, w32)
    assert_same_bits(dx, dx32.to(dy.dtype).reshape(dy.shape), "dx vs the documented order")
    assert_same_bits(dweight, dweight32, "dweight vs the documented order")

    dx64, dweight64 = ref.rmsnorm_backward(rows_of(dy), x_deq, rstd, weight)
    # the same formula, computed by PyTorch in bf16
    xhat = x_deq.bfloat16() * rstd.bfloat16().unsqueeze(-1)
    g = rows_of(dy).bfloat16() * weight.bfloat16()
    dx_bf16 = rstd.bfloat16().unsqueeze(-1) * (g - xhat * (g * xhat).mean(dim=-1, keepdim=True))
    dweight_bf16 = (rows_of(dy).bfloat16() * xhat).sum(dim=0)
    assert max_error(rows_of(dx), dx64) <= 2 * max_error(dx_bf16, dx64)
    assert max_error(dweight, dweight64) <= 2 * max_error(dweight_bf16, dweight64)


@pytest.mark.parametrize("shape", RMSNORM_SHAPES, ids=str)
def test_rmsnorm_backward(device, shape):
    dy, x_saved, x_saved_scales, rstd, weight = rmsnorm_backward_case(shape, torch.bfloat16, seed=shape[1])
    dx, dweight = run(torch.ops.coat.rmsnorm_backward, dy, x_saved, x_saved_scales, rstd, weight, 16, device=device)
    assert dx.dtype == dy.dtype and dweight.dtype == torch.float32 and dweight.shape == (shape[-1],)
    check_rmsnorm_backward(dy, x_saved, x_saved_scales, rstd, weight, 16, dx, dweight)


@pytest.mark.parametrize("dy_dtype, weight_dtype, group_size", [
    (torch.float32, torch.float32, 32), (torch.float16, torch.bfloat16, 64), (torch.bfloat16, torch.float32, 128),
], ids=str)
def test_rmsnorm_backward_dtypes_and_groups(device, dy_dtype, weight_dtype, group_size):
    case = rmsnorm_backward_case((300, 1000), dy_dtype, weight_dtype, group_size, seed=11)
    dx, dweight = run(torch.ops.coat.rmsnorm_backward, *case, group_size, device=device)
    assert dx.dtype == dy_dtype
    check_rmsnorm_backward(*case, group_size, dx, dweight)


def test_rmsnorm_backward_nd_strided_dy(device):
    x = activations((2, 7, 128), torch.bfloat16, seed=12)
    weight = torch.rand(128).bfloat16() + 0.5
    _, _, _, x_saved, x_saved_scales, rstd = rmsnorm_forward(x, weight)
    dy = activations((2, 7, 160), torch.bfloat16, seed=13)[..., 16:144]
    dx, dweight = run(torch.ops.coat.rmsnorm_backward, dy, x_saved, x_saved_scales, rstd, weight, 16, device=device)
    assert dx.shape == (2, 7, 128) and dx.is_contiguous()
    check_rmsnorm_backward(dy, x_saved, x_saved_scales, rstd, weight, 16, dx, dweight)


def test_rmsnorm_backward_many_slices(device):
    """More rows than the maximum number of dweight slices, with a last slice that is short."""
    cols = 64
    rows = 3 * max(128, 65536 // ref.rmsnorm_lanes(cols)) + 5
    assert ref.rmsnorm_backward_rows_per_slice(rows, cols) == 4
    case = rmsnorm_backward_case((rows, cols), torch.bfloat16, seed=14)
    dx, dweight = run(torch.ops.coat.rmsnorm_backward, *case, 16, device=device)
    check_rmsnorm_backward(*case, 16, dx, dweight)


@pytest.mark.parametrize("cols", [1032, 4096, 8192, 16384, 20000, 32768])
def test_rmsnorm_every_row_width_class(device, cols):
    """One shape per number of lanes L a row is reduced by (64 ... 1024: the CUDA kernels use 256-, 512- and
    1024-thread blocks, and the widest rows keep part of their state in shared memory)."""
    x = activations((3, cols), torch.bfloat16, seed=cols)
    weight = (1 + 0.2 * torch.randn(cols, generator=torch.Generator().manual_seed(cols))).bfloat16()
    outputs = rmsnorm_forward(x, weight, device=device)
    check_rmsnorm_forward(x, weight, outputs)
    _, _, _, x_saved, x_saved_scales, rstd = outputs
    dy = activations((3, cols), torch.bfloat16, seed=cols + 1, outliers=False)
    dx, dweight = run(torch.ops.coat.rmsnorm_backward, dy, x_saved, x_saved_scales, rstd, weight, 16, device=device)
    check_rmsnorm_backward(dy, x_saved, x_saved_scales, rstd, weight, 16, dx, dweight)


def test_rmsnorm_zero_rows(device):
    x = torch.empty(0, 64, dtype=torch.bfloat16)
    weight = torch.ones(64, dtype=torch.bfloat16)
    y, y_scale, y_t, x_saved, x_saved_scales, rstd = rmsnorm_forward(x, weight, device=device)
    assert y.shape == (0, 64) and y_t.shape == (64, 0) and rstd.shape == (0,)
    assert y_scale.item() == 2.0**-126
    dx, dweight = run(torch.ops.coat.rmsnorm_backward, x, x_saved, x_saved_scales, rstd, weight, 16, device=device)
    assert dx.shape == (0, 64) and (dweight == 0).all()
    dx, dweight = run(torch.ops.coat.rmsnorm_backward, x, x_saved, x_saved_scales, rstd, weight, 16, x.float(),
                      device=device)
    assert dx.shape == (0, 64) and dx.dtype == torch.float32 and (dweight == 0).all()


# With a residual gradient: dx = round(residual dtype, float(dx in dy's dtype) + residual), which is torch's
# dx.to(residual.dtype) + residual when dy's dtype converts to residual's exactly; NaN canonical.


def canonical_nan(t: torch.Tensor) -> torch.Tensor:
    """t with every NaN the canonical quiet NaN (torch's own: 0x7FC00000, bf16 0x7FC0, fp16 0x7E00)."""
    return torch.where(t.isnan(), torch.full_like(t, math.nan), t)


def check_rmsnorm_backward_residual(case, residual, device) -> torch.Tensor:
    """dx and dweight with the residual against the op without it; returns dx."""
    dx, dweight = run(torch.ops.coat.rmsnorm_backward, *case, 16, device=device)
    dx_residual, dweight_residual = run(torch.ops.coat.rmsnorm_backward, *case, 16, residual, device=device)
    assert dx_residual.dtype == residual.dtype and dx_residual.shape == dx.shape
    assert_same_bits(dx_residual, canonical_nan(dx.to(residual.dtype) + residual), "dx vs dx + residual in torch")
    assert_same_bits(dweight_residual, dweight, "dweight with a residual vs without")
    return dx_residual


# (97, 1000): the CUDA kernel's 16-byte path; (5, 100): element by element (H % 8 != 0)
@pytest.mark.parametrize("shape", [(97, 1000), (5, 100)], ids=str)
@pytest.mark.parametrize("dy_dtype, residual_dtype", [
    (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32),
    (torch.float16, torch.float16),
], ids=str)
def test_rmsnorm_backward_residual(device, shape, dy_dtype, residual_dtype):
    case = rmsnorm_backward_case(shape, dy_dtype, seed=15)
    residual = activations(shape, residual_dtype, seed=16)
    check_rmsnorm_backward_residual(case, residual, device)


def test_rmsnorm_backward_residual_nd_and_wrapper(device):
    """An N-D dy read as row-strided rows with a contiguous residual of its shape, through coat.ops."""
    x = activations((2, 7, 128), torch.bfloat16, seed=17)
    weight = torch.rand(128).bfloat16() + 0.5
    _, _, _, x_saved, x_saved_scales, rstd = rmsnorm_forward(x, weight)
    dy = activations((2, 7, 160), torch.bfloat16, seed=18)[..., 16:144]
    residual = activations((2, 7, 128), torch.float32, seed=19)
    dx = check_rmsnorm_backward_residual((dy, x_saved, x_saved_scales, rstd, weight), residual, device)
    assert dx.shape == (2, 7, 128) and dx.is_contiguous()
    dx_ops, _ = ops.rmsnorm_backward(*(on_device(t, device) for t in (dy, x_saved, x_saved_scales, rstd, weight)),
                                     residual=on_device(residual, device))
    assert_same_bits(dx_ops.cpu(), dx, "coat.ops.rmsnorm_backward(residual=)")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_rmsnorm_backward_residual_special_values(device, dtype):
    """NaN (of either sign) and +-Inf in the residual, rows of dx that are NaN or +-Inf (from dy), sums past the
    dtype's largest value: each as the formula says, every NaN canonical (positive)."""
    case = rmsnorm_backward_case((8, 512), dtype, seed=20)
    case[0][4, 7], case[0][5, 9] = math.nan, math.inf  # dx: row 4 NaN; row 5 +-Inf, NaN at the Inf
    residual = activations((8, 512), dtype, seed=21, outliers=False)
    residual[0, 1], residual[0, 2], residual[0, 3], residual[4, 7] = math.nan, math.inf, -math.inf, math.inf
    nan_bits = bits(torch.tensor(math.nan, dtype=dtype))
    bits(residual)[1] = nan_bits | torch.iinfo(nan_bits.dtype).min  # a negative NaN: the sign bit set
    largest = torch.finfo(dtype).max
    case[0][2:4] *= largest / 100  # dx of rows 2 and 3 up to 1% of largest, past half the last step below it
    residual[2, :] = largest
    residual[3, :] = -largest
    dx = check_rmsnorm_backward_residual(case, residual, device)
    assert dx[0, 1].isnan() and dx[0, 2] == math.inf and dx[0, 3] == -math.inf
    assert dx[[1, 4]].isnan().all() and (bits(dx[1]) == bits(torch.tensor(math.nan, dtype=dtype))).all()
    assert not dx[5].isfinite().any()
    assert dx[2].isinf().any() and dx[3].isinf().any()  # largest + dx rounds past the largest value


# ----------------------------------------------------------------------------------------------------
# SiLU * mul forward

SILU_SHAPES = [(1, 64), (97, 128), (4097, 176), (97, 2048), (1, 11008), (33, 11008), (97, 1000), (5, 100), (3, 7)]


def check_silu_mul_forward(gate, up, smooth, outputs, group_size=16, activation="silu") -> None:
    y, y_scale, y_t, gate_saved, gate_scales, up_saved, up_scales = outputs
    y32 = ref.silu_mul_f32(gate.float(), up.float(), smooth, activation)
    check_tied_to_quantize_tensor(y, y_scale, y32, y_t)
    check_fp8_output(y, y_scale, ref.silu_mul(gate, up, smooth, activation))
    check_tied_to_quantize_group(gate_saved, gate_scales, gate, group_size)
    check_tied_to_quantize_group(up_saved, up_scales, up, group_size)


def gate_up(shape, dtype, seed):
    """gate and up as the two halves of one [..., 2I] GEMM output: row-strided views."""
    fused = activations((*shape[:-1], 2 * shape[-1]), dtype, seed=seed)
    return fused[..., : shape[-1]], fused[..., shape[-1] :]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SILU_SHAPES, ids=str)
def test_silu_mul_forward(device, shape, activation):
    gate, up = gate_up(shape, torch.bfloat16, seed=shape[1])
    outputs = silu_mul_forward(gate, up, device=device, activation=activation)
    check_silu_mul_forward(gate, up, None, outputs, activation=activation)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype, group_size, fp8", [
    (torch.float32, 32, E4M3), (torch.float16, 64, E5M2), (torch.bfloat16, 128, E5M2),
], ids=str)
def test_silu_mul_forward_smooth_dtypes_and_groups(device, dtype, group_size, fp8, activation):
    gate, up = activations((33, 1000), dtype, seed=21), activations((33, 1000), dtype, seed=22)
    smooth = torch.exp(torch.randn(1000, generator=torch.Generator().manual_seed(23)))
    outputs = silu_mul_forward(gate, up, smooth, group_size=group_size, fp8=fp8, device=device, activation=activation)
    assert outputs[0].dtype == fp8
    check_silu_mul_forward(gate, up, smooth, outputs, group_size, activation)


def test_silu_mul_forward_nd_and_views(device):
    gate, up = gate_up((2, 3, 5, 100), torch.bfloat16, seed=24)  # up starts 200 bytes in: not 16-byte aligned
    outputs = silu_mul_forward(gate, up, device=device)
    assert outputs[0].shape == (2, 3, 5, 100) and outputs[2].shape == (100, 30)
    assert outputs[4].shape == (2, 3, 5, 7)
    check_silu_mul_forward(gate, up, None, outputs)
    flat = silu_mul_forward(rows_of(gate.contiguous()), rows_of(up.contiguous()))
    for nd, two_d in zip(outputs, flat):
        assert_same_bits(nd.reshape(two_d.shape), two_d, "N-D strided vs 2-D contiguous")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape, group_size", BLOCK_SAVE_CASES, ids=str)
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_silu_mul_forward_saves_fp4_and_fp6(device, fmt, shape, group_size, activation):
    """gate and up kept as quantize_blocks(., fmt, G) bit for bit; y, y_scale and y_t as with E4M3."""
    gate, up = gate_up(shape, torch.bfloat16, seed=shape[1] + 1)
    gate[0, 0], up[-1, -1] = float("nan"), float("-inf")
    packed = silu_mul_forward(gate, up, group_size=group_size, device=device, save_format=fmt, activation=activation)
    e4m3 = silu_mul_forward(gate, up, group_size=group_size, device=device, activation=activation)
    for saved, source, name in ((packed[3:5], gate, "gate"), (packed[5:7], up, "up")):
        codes, scales = ops.quantize_blocks(source, fmt, group_size)
        assert_same_bits(saved[0], codes, f"{name}_saved vs quantize_blocks {fmt}")
        assert_same_bits(saved[1], scales, f"{name}_scales vs quantize_blocks {fmt}")
    for i in (0, 1, 2):
        assert_same_bits(packed[i], e4m3[i], "an output other than the saved copies")
    wrapped = ops.silu_mul_quantize(gate, up, save_group_size=group_size, save_format=fmt, activation=activation)
    for i in (3, 4, 5, 6):
        assert_same_bits(wrapped[i], packed[i], f"coat.ops.silu_mul_quantize(save_format={fmt!r}) output {i}")
    with pytest.raises(ValueError, match="save_format must be 'e4m3', 'fp4' or 'fp6', got 'fp8'"):
        ops.silu_mul_quantize(gate, up, save_format="fp8")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_silu_mul_forward_special_values(device, activation):
    """NaN gate or up gives a NaN code at that element only; act(-Inf) is NaN, as in PyTorch; a +Inf
    product makes y_scale Inf, so that y dequantizes to NaN/0 instead of silently clipping the overflow
    (the rule of quantize_tensor). Zero inputs give zero codes and the smallest scale."""
    gate, up = activations((4, 64), torch.bfloat16, seed=25), activations((4, 64), torch.bfloat16, seed=26)
    gate[0, 3], up[1, 4], gate[2, 5] = math.nan, math.nan, -math.inf
    outputs = silu_mul_forward(gate, up, device=device, activation=activation)
    codes = outputs[0].view(torch.uint8)
    assert codes[0, 3] == 0x7F and codes[1, 4] == 0x7F and codes[2, 5] == 0x7F
    assert int(((codes & 0x7F) == 0x7F).sum()) == 3 and torch.isfinite(outputs[1])
    check_silu_mul_forward(gate, up, None, outputs, activation=activation)

    gate[3, 6], up[3, 6] = math.inf, 2.0
    outputs = silu_mul_forward(gate, up, device=device, activation=activation)
    assert outputs[1].item() == math.inf
    codes = outputs[0].view(torch.uint8)
    nan = (codes & 0x7F) == 0x7F
    assert codes[3, 6] == 0x7F and ((codes[~nan] & 0x7F) == 0).all()  # finite / Inf is +-0
    check_tied_to_quantize_group(outputs[3], outputs[4], gate, 16)

    zeros = torch.zeros(3, 32, dtype=torch.bfloat16)
    y, y_scale, *_ = silu_mul_forward(zeros, zeros, device=device, activation=activation)
    assert (y.view(torch.uint8) == 0).all() and y_scale.item() == 2.0**-126


# ----------------------------------------------------------------------------------------------------
# SiLU * mul backward


def check_silu_mul_backward(dy, saved, smooth, group_size, dgate, dup, d_amax, activation="silu") -> None:
    """dgate and dup against the documented fp32 arithmetic (bit for bit) and the float64 formula (the bf16
    tolerance rule); d_amax against the largest magnitude of the two outputs, NaN ignored (bit for bit)."""
    magnitudes = torch.cat([dgate.float().abs().flatten(), dup.float().abs().flatten()])
    expected_amax = torch.nan_to_num(magnitudes, nan=0.0).max() if magnitudes.numel() else torch.tensor(0.0)
    assert d_amax.dtype == torch.float32 and d_amax.shape == ()
    assert_same_bits(d_amax.cpu(), expected_amax, "d_amax vs max(|dgate|, |dup|)")
    gate_saved, gate_scales, up_saved, up_scales = saved
    g = ops.dequantize(gate_saved, gate_scales, group_size, torch.float32)
    u = ops.dequantize(up_saved, up_scales, group_size, torch.float32)
    dgate32, dup32 = ref.silu_mul_backward_f32(dy.float(), g, u, smooth, activation)
    assert_same_bits(dgate, dgate32.to(dy.dtype), "dgate vs the documented arithmetic")
    assert_same_bits(dup, dup32.to(dy.dtype), "dup vs the documented arithmetic")

    dgate64, dup64 = ref.silu_mul_backward(dy, g, u, smooth, activation)
    # the same formula, computed by PyTorch in bf16 (gelu_tanh: torch's own gelu and gelu_backward)
    dy_b = dy.bfloat16() if smooth is None else dy.bfloat16() * smooth.bfloat16()
    g_b, u_b = g.bfloat16(), u.bfloat16()
    if activation == "silu":
        s = torch.sigmoid(g_b)
        dgate_bf16, dup_bf16 = dy_b * u_b * s * (1 + g_b * (1 - s)), dy_b * g_b * s
    else:
        dgate_bf16 = torch.ops.aten.gelu_backward(dy_b * u_b, g_b, approximate="tanh")
        dup_bf16 = dy_b * torch.nn.functional.gelu(g_b, approximate="tanh")
    assert max_error(dgate, dgate64) <= 2 * max_error(dgate_bf16, dgate64)
    assert max_error(dup, dup64) <= 2 * max_error(dup_bf16, dup64)


def silu_mul_backward_case(shape, dtype, smooth=None, group_size=16, seed=0):
    gate, up = gate_up(shape, torch.bfloat16, seed=seed)
    outputs = silu_mul_forward(gate, up, smooth, group_size=group_size, transpose=False)
    return activations(shape, dtype, seed=seed + 1, outliers=False), outputs[3:]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SILU_SHAPES, ids=str)
def test_silu_mul_backward(device, shape, activation):
    dy, saved = silu_mul_backward_case(shape, torch.bfloat16, seed=shape[1])
    dgate, dup, d_amax = run(torch.ops.coat.silu_mul_backward, dy, *saved, None, 16, "e4m3", activation, device=device)
    check_silu_mul_backward(dy, saved, None, 16, dgate, dup, d_amax, activation)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype, group_size", [(torch.float32, 32), (torch.float16, 64), (torch.bfloat16, 128)], ids=str)
def test_silu_mul_backward_smooth_dtypes_and_groups(device, dtype, group_size, activation):
    smooth = torch.exp(torch.randn(1000, generator=torch.Generator().manual_seed(31)))
    dy, saved = silu_mul_backward_case((33, 1000), dtype, smooth, group_size, seed=32)
    dgate, dup, d_amax = run(torch.ops.coat.silu_mul_backward, dy, *saved, smooth, group_size, "e4m3", activation,
                             device=device)
    assert dgate.dtype == dtype and dup.dtype == dtype
    check_silu_mul_backward(dy, saved, smooth, group_size, dgate, dup, d_amax, activation)


def test_silu_mul_backward_strided_dy(device):
    dy_wide, saved = silu_mul_backward_case((2, 9, 176), torch.bfloat16, seed=33)
    dy = torch.cat([dy_wide, dy_wide], dim=-1)[..., 3:179]
    dgate, dup, d_amax = run(torch.ops.coat.silu_mul_backward, dy, *saved, None, 16, device=device)
    assert dgate.shape == (2, 9, 176) and dgate.is_contiguous()
    check_silu_mul_backward(dy, saved, None, 16, dgate, dup, d_amax)


def test_coat_exp_accuracy():
    """The exp that SiLU uses (replayed in fp32; the backward tests tie the kernels to the replay bit for
    bit): below 1 ulp over its whole normal range, exact at the special values."""
    x = torch.cat([torch.linspace(-87.3, 88.72, 2_000_001), 30 * torch.randn(200_000, generator=torch.Generator().manual_seed(0))])
    x = x[(x > -87.3) & (x < 88.72)]
    e = ref.coat_exp(x).double()
    exact = torch.exp(x.double())
    ulp = torch.pow(2.0, torch.floor(torch.log2(exact)) - 23)
    assert ((e - exact).abs() / ulp).max().item() < 1.0
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 89.0, -104.0])
    e = ref.coat_exp(special)
    assert e[:4].tolist() == [1.0, 1.0, math.inf, 0.0] and math.isnan(e[4]) and e[5] == math.inf and e[6] == 0


# ----------------------------------------------------------------------------------------------------
# GeGLU's gelu_tanh: accuracy of the documented fp32 arithmetic, which the kernels equal bit for bit (above)

GELU_GATES = torch.cat([torch.linspace(-12.0, 12.0, 480_001),
                        3 * torch.randn(200_000, generator=torch.Generator().manual_seed(9))])


def test_gelu_tanh_accuracy():
    """act and act' of gelu_tanh in fp32 (coat's g * sigmoid(z), replayed) against the float64 formula: max error at
    most 2x that of torch's own float32 gelu(approximate="tanh") and its autograd, the bf16 rule at fp32."""
    g = GELU_GATES
    act64, dact64 = ref.activation64(g, "gelu_tanh")
    act32 = g * ref.activation_sigmoid_f32(g, "gelu_tanh")
    dact32 = ref.activation_slope_f32(g, ref.activation_sigmoid_f32(g, "gelu_tanh"), "gelu_tanh")
    g_torch = g.clone().requires_grad_()
    act_torch = torch.nn.functional.gelu(g_torch, approximate="tanh")
    act_torch.sum().backward()
    assert max_error(act32, act64) <= 2 * max_error(act_torch.detach(), act64)
    assert max_error(dact32, dact64) <= 2 * max_error(g_torch.grad, dact64)


def unit_saved(gates: torch.Tensor, group_size=16):
    """A saved copy whose decoded values are exactly `gates` (each an E4M3 value times its scale): code 1.0
    (0x38) and the gate as the scale, one group per gate, for gates special or out of E4M3's range."""
    rows = gates.numel()
    codes = torch.full((rows, group_size), 0x38, dtype=torch.uint8).view(E4M3)
    return codes, gates.float().reshape(rows, 1)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_special_gates(device, activation):
    """act and act' at +-Inf, NaN, huge, tiny, zero and very negative gates, through the backward with dy = 1 and
    up = 1 (dup = act(g), dgate = act'(g), exactly): act as torch's float32 (silu, gelu(approximate="tanh")) at
    every such gate; gelu_tanh' finite for every finite gate, its limits 1 and 0 at +-Inf (torch: NaN from
    |g| ~ 1.8e19 on), silu' NaN at +-Inf (Inf * 0)."""
    gates = torch.tensor([math.inf, -math.inf, math.nan, 1e30, -1e30, 3e38, -3e38, 2e19, -2e19, 1e-30, 1e-39,
                          0.0, -0.0, -10.0, -20.0, -88.0, 10.0, 0.5, -0.5])
    gate_saved, gate_scales = unit_saved(gates)
    up_saved, up_scales = unit_saved(torch.ones_like(gates))
    dy = torch.ones(gates.numel(), 16)
    dgate, dup, _ = run(torch.ops.coat.silu_mul_backward, dy, gate_saved, gate_scales, up_saved, up_scales, None, 16,
                        "e4m3", activation, device=device)
    act, dact = dup[:, 0], dgate[:, 0]
    torch_act = (gates * torch.sigmoid(gates) if activation == "silu"
                 else torch.nn.functional.gelu(gates, approximate="tanh"))
    assert_same_bits(act.isnan(), torch_act.isnan(), "act's NaNs vs torch's")
    assert act[0] == math.inf and act[1].isnan() and act[2].isnan()
    # act within float32's reach of float64's: g * sigmoid(z), which 0.5 g (1 + tanh(z / 2)) equals but computes without
    # cancelling to 0 below about -9 (torch's float32 and the float64 formula's float64 do)
    finite = gates.isfinite()
    g64 = gates[finite].double()
    z64 = g64 if activation == "silu" else 2 * ref.SQRT_2_OVER_PI * (g64 + 0.044715 * g64**3)
    act64 = g64 * torch.sigmoid(z64)
    assert torch.allclose(act[finite].double(), act64, rtol=1e-4, atol=1e-44)
    assert (act[finite].signbit() == gates[finite].signbit()).all()
    if activation == "gelu_tanh":
        assert dact[2].isnan() and not dact[torch.arange(gates.numel()) != 2].isnan().any()
        assert dact[0] == 1.0 and dact[1] == 0.0 and dact[3] == 1.0 and dact[4] == 0.0 and dact[7] == 1.0
        assert dact[9] == 0.5 and dact[11] == 0.5 and abs(dact[13]) < 1e-30 and dact[14] == 0.0
    else:
        assert dact[:3].isnan().all() and not dact[3:].isnan().any()
    g, u = ref.decode_saved(gate_saved, gate_scales, 16), ref.decode_saved(up_saved, up_scales, 16)
    assert_same_bits(canonical_nan(dgate), canonical_nan(ref.silu_mul_backward_f32(dy, g, u, activation=activation)[0]),
                     "dgate vs the replay")


def test_activation_errors():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    _, y_scale, _, *saved = ops.silu_mul_quantize(x, x)
    message = "activation must be 'silu' \\(SwiGLU\\) or 'gelu_tanh' \\(GeGLU"
    for call in (lambda: ops.silu_mul_quantize(x, x, activation="gelu"),
                 lambda: ops.silu_mul_backward(x, *saved, activation="relu"),
                 lambda: ops.silu_mul_requantize(*saved, None, y_scale, activation="swish")):
        with pytest.raises(ValueError, match=message):
            call()
    for call in (lambda: torch.ops.coat.silu_mul_quantize(x, x, None, 16, 128, E4M3, False, "e4m3", "gelu"),
                 lambda: torch.ops.coat.silu_mul_backward(x, *saved, None, 16, "e4m3", "GELU_TANH"),
                 lambda: torch.ops.coat.silu_mul_requantize(*saved, None, y_scale, 16, E4M3, "e4m3", None, "tanh")):
        with pytest.raises(RuntimeError, match=message):
            call()
    with torch._subclasses.FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
        with pytest.raises(RuntimeError, match=message):
            torch.ops.coat.silu_mul_quantize(fake, fake, None, 16, 128, E4M3, False, "e4m3", "gelu")


# ----------------------------------------------------------------------------------------------------
# Requantize: the forward's y_t recomputed from what it saved
#
# Bit for bit: y_t equals the fp32 replay of the forward's formula on the decoded saved inputs (SiLU*mul: with
# the decoded gate rounded to bf16, reference_norm_act.silu_mul_requantize_f32), quantized with the given
# y_scale (reference_norm_act.quantize_with_scale), NaN codes positive. Against the forward: where every input
# is FP8-representable in its group (x == x'; for SiLU*mul bf16 gates, which the bf16 rounding keeps), y_t
# equals the forward's y_t bit for bit; in general the saved x' is within half an E4M3 step of x (e_x), so y'
# is within D of y (RMSNorm: D = e_x |rstd * weight|; SiLU*mul: D = smooth (1.1 e_g (|u| + e_u) +
# |silu(g)| e_u), silu being 1.1-Lipschitz, with e_g = e_x of the gate + 2^-8 (|g| + e_x) for the bf16
# rounding), and the two codes, each within half an FP8 step of its value (or saturated, which only
# brings it closer), differ by at most D / y_scale + half a step of each code, plus 1e-5 relative for the
# fp32 arithmetic.


def requantize(op, *args, device):
    (y_t,) = run(lambda *a: (op(*a),), *args, device=device)
    return y_t


def rmsnorm_requantize(saved, rstd, weight, y_scale, group_size=16, fp8=E4M3, device="cpu"):
    return requantize(torch.ops.coat.rmsnorm_requantize, *saved, rstd, weight, y_scale, group_size, fp8, device=device)


def silu_mul_requantize(saved, smooth, y_scale, group_size=16, fp8=E4M3, device="cpu", activation="silu"):
    return requantize(torch.ops.coat.silu_mul_requantize, *saved, smooth, y_scale, group_size, fp8, "e4m3", None,
                      activation, device=device)


def check_requantized(y_t, y32, y_scale) -> None:
    """y_t is quantize_with_scale(y32, y_scale), transposed, with positive NaN codes."""
    expected = nan_codes_unsigned(ref.quantize_with_scale(y32, y_scale, y_t.dtype)).T.contiguous()
    assert y_t.shape == expected.shape and y_t.is_contiguous()
    assert_same_bits(y_t, expected, "y_t vs the fp32 replay with the given scale")


def check_near_forward(y_t, forward_y_t, y_scale, bound) -> None:
    """The module comment's bound: |code - forward code| <= bound / y_scale + half a step of each + slack."""
    v, v_forward = y_t.double().T, forward_y_t.double().T
    step = 0.5 * (ref.fp8_step(v, y_t.dtype) + ref.fp8_step(v_forward, y_t.dtype))
    allowed = bound / y_scale.double() + step + 1e-5 * (v.abs() + v_forward.abs())
    assert ((v - v_forward).abs() <= allowed).all(), f"max excess {((v - v_forward).abs() - allowed).max().item()}"


def fp8_representable(shape, dtype, group_size, seed) -> torch.Tensor:
    """Values that E4M3 with 1 x G groups holds exactly: random finite E4M3 codes times a power of two per
    group, with one code of each group +-448, so that the saved scale is that power of two."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 254, shape, generator=g, dtype=torch.uint8)
    codes = torch.where(codes >= 0x7F, codes + 1, codes)  # no NaN codes (0x7F, 0xFF)
    codes[..., ::group_size] = torch.where(codes[..., ::group_size] < 0x80, 0x7E, 0xFE).to(torch.uint8)
    values = codes.view(E4M3).float()
    groups = -(-shape[-1] // group_size)
    exponents = torch.randint(-10, 1, (*shape[:-1], groups), generator=g).repeat_interleave(group_size, dim=-1)
    return (values * torch.pow(2.0, exponents[..., : shape[-1]].float())).to(dtype)


REQUANTIZE_SHAPES = [(1, 64), (97, 128), (67, 176), (5, 100), (3, 7), (0, 64), (2, 3, 5, 40)]


@pytest.mark.parametrize("shape", REQUANTIZE_SHAPES, ids=str)
def test_rmsnorm_requantize(device, shape):
    x = activations(shape, torch.bfloat16, seed=70 + shape[-1])
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=torch.Generator().manual_seed(71))).bfloat16()
    _, y_scale, y_t, *saved, rstd = rmsnorm_forward(x, weight)
    requantized = rmsnorm_requantize(saved, rstd, weight, y_scale, device=device)
    check_requantized(requantized, ref.rmsnorm_forward_f32(ref.decode_saved(*saved, 16), rstd, weight.float()), y_scale)
    bound = ref.e4m3_half_step(x, saved[1], 16) * (rstd.double().unsqueeze(-1) * weight.double()).abs()
    check_near_forward(requantized, y_t, y_scale, bound)


@pytest.mark.parametrize("weight_dtype, group_size, fp8", [
    (torch.float32, 16, E5M2), (torch.bfloat16, 32, E4M3), (torch.float16, 64, E5M2), (torch.float32, 128, E4M3),
], ids=str)
def test_rmsnorm_requantize_dtypes_and_groups(device, weight_dtype, group_size, fp8):
    x = activations((33, 1000), torch.bfloat16, seed=72)  # 1000 % G != 0: a short last group for every G
    weight = (1 + 0.2 * torch.randn(1000, generator=torch.Generator().manual_seed(73))).to(weight_dtype)
    _, y_scale, y_t, *saved, rstd = rmsnorm_forward(x, weight, group_size=group_size, fp8=fp8)
    requantized = rmsnorm_requantize(saved, rstd, weight, y_scale, group_size, fp8, device=device)
    assert requantized.dtype == fp8
    check_requantized(requantized, ref.rmsnorm_forward_f32(ref.decode_saved(*saved, group_size), rstd, weight.float()),
                      y_scale)
    bound = ref.e4m3_half_step(x, saved[1], group_size) * (rstd.double().unsqueeze(-1) * weight.double()).abs()
    check_near_forward(requantized, y_t, y_scale, bound)


@pytest.mark.parametrize("x_dtype, group_size, fp8", [
    (torch.bfloat16, 16, E4M3), (torch.float32, 32, E5M2), (torch.float16, 64, E4M3), (torch.bfloat16, 128, E5M2),
], ids=str)
def test_rmsnorm_requantize_equals_forward_on_representable_x(device, x_dtype, group_size, fp8):
    x = fp8_representable((37, 300), x_dtype, group_size, seed=74)
    weight = (1 + 0.2 * torch.randn(300, generator=torch.Generator().manual_seed(75))).bfloat16()
    _, y_scale, y_t, *saved, rstd = rmsnorm_forward(x, weight, group_size=group_size, fp8=fp8)
    assert_same_bits(ref.decode_saved(*saved, group_size), x.float(), "x' vs x")
    assert_same_bits(rmsnorm_requantize(saved, rstd, weight, y_scale, group_size, fp8, device=device), y_t,
                     "requantized y_t vs the forward's")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_silu_mul_requantize_equals_forward_on_representable_inputs(device, activation):
    for group_size, fp8, smooth in ((16, E4M3, None), (128, E5M2, torch.rand(300) + 0.5)):
        gate = fp8_representable((37, 300), torch.bfloat16, group_size, seed=76)
        up = fp8_representable((37, 300), torch.bfloat16, group_size, seed=77)
        _, y_scale, y_t, *saved = silu_mul_forward(gate, up, smooth, group_size=group_size, fp8=fp8,
                                                   activation=activation)
        requantized = silu_mul_requantize(saved, smooth, y_scale, group_size, fp8, device=device, activation=activation)
        assert_same_bits(requantized, y_t, "requantized y_t vs the forward's")


def silu_mul_bound(gate, up, saved, smooth, group_size, activation="silu"):
    g, u = rows_of(gate).double(), rows_of(up).double()
    e_g = ref.e4m3_half_step(gate, saved[1], group_size)
    e_g = e_g + 2.0**-8 * (g.abs() + e_g)  # bf16(g') is within half a bf16 ulp, under 2^-8 |g'|, of g'
    e_u = ref.e4m3_half_step(up, saved[3], group_size)
    bound = ref.LIPSCHITZ[activation] * e_g * (u.abs() + e_u) + ref.activation64(g, activation)[0].abs() * e_u
    return bound if smooth is None else bound * smooth.double()


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", REQUANTIZE_SHAPES, ids=str)
def test_silu_mul_requantize(device, shape, activation):
    gate, up = gate_up(shape, torch.bfloat16, seed=78 + shape[-1])
    _, y_scale, y_t, *saved = silu_mul_forward(gate, up, activation=activation)
    requantized = silu_mul_requantize(saved, None, y_scale, device=device, activation=activation)
    y32 = ref.silu_mul_requantize_f32(ref.decode_saved(*saved[:2], 16), ref.decode_saved(*saved[2:], 16),
                                      activation=activation)
    check_requantized(requantized, y32, y_scale)
    check_near_forward(requantized, y_t, y_scale, silu_mul_bound(gate, up, saved, None, 16, activation))


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype, group_size, fp8, smooth", [
    (torch.float32, 32, E4M3, True), (torch.float16, 64, E5M2, False), (torch.bfloat16, 128, E5M2, True),
    (torch.bfloat16, 16, E4M3, True),
], ids=str)
def test_silu_mul_requantize_smooth_dtypes_and_groups(device, dtype, group_size, fp8, smooth, activation):
    gate, up = activations((33, 1000), dtype, seed=79), activations((33, 1000), dtype, seed=80)
    smooth = torch.exp(torch.randn(1000, generator=torch.Generator().manual_seed(81))) if smooth else None
    _, y_scale, y_t, *saved = silu_mul_forward(gate, up, smooth, group_size=group_size, fp8=fp8, activation=activation)
    requantized = silu_mul_requantize(saved, smooth, y_scale, group_size, fp8, device=device, activation=activation)
    assert requantized.dtype == fp8
    y32 = ref.silu_mul_requantize_f32(ref.decode_saved(*saved[:2], group_size), ref.decode_saved(*saved[2:], group_size),
                                      smooth, activation)
    check_requantized(requantized, y32, y_scale)
    check_near_forward(requantized, y_t, y_scale, silu_mul_bound(gate, up, saved, smooth, group_size, activation))


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=str)
def test_requantize_saturates(device, fp8):
    """A y_scale below the one the values need saturates them to +-FP8_MAX, never NaN: a quarter of the
    forward's, and 2^-126, whose quotients overflow fp32 for the largest values (E4M3 saturates those too;
    E5M2 encodes them as Inf, as its encoder does any infinite quotient)."""
    x = activations((9, 256), torch.bfloat16, seed=82)
    weight = torch.full((256,), 1e4, dtype=torch.bfloat16)
    _, y_scale, _, *saved, rstd = rmsnorm_forward(x, weight, fp8=fp8)
    rmsnorm_y32 = ref.rmsnorm_forward_f32(ref.decode_saved(*saved, 16), rstd, weight.float())
    gate, up = gate_up((9, 256), torch.bfloat16, seed=83)
    _, silu_scale, _, *silu_saved = silu_mul_forward(gate, up, fp8=fp8)
    silu_y32 = ref.silu_mul_requantize_f32(ref.decode_saved(*silu_saved[:2], 16),
                                           ref.decode_saved(*silu_saved[2:], 16))
    fp8_max = ref.FP8_MAX[fp8]
    tiny = torch.tensor(2.0**-126)
    cases = []
    for scale in (y_scale / 4, tiny):
        cases.append((rmsnorm_requantize(saved, rstd, weight, scale, fp8=fp8, device=device), rmsnorm_y32, scale))
    for scale in (silu_scale / 4, tiny):
        cases.append((silu_mul_requantize(silu_saved, None, scale, fp8=fp8, device=device), silu_y32, scale))
    for y_t, y32, scale in cases:
        check_requantized(y_t, y32, scale)
        values = y_t.float()
        overflow = (y32 / scale).isinf().T
        assert not values.isnan().any() and (values.abs() == fp8_max).any()
        assert (values[~overflow].abs() <= fp8_max).all()
        assert (values[overflow].abs() == (fp8_max if fp8 == E4M3 else math.inf)).all()
    assert (rmsnorm_y32 / tiny).isinf().any() and (silu_y32 / tiny).isinf().any()  # overflows are exercised


def test_requantize_python_wrappers():
    """coat.ops's wrappers: the defaults (G = 16, E4M3) and a format given by name."""
    x = activations((5, 48), torch.bfloat16, seed=86)
    weight = torch.ones(48, dtype=torch.bfloat16)
    _, y_scale, _, *saved, rstd = ops.rmsnorm_quantize(x, weight)
    assert_same_bits(ops.rmsnorm_requantize(*saved, rstd, weight, y_scale),
                     torch.ops.coat.rmsnorm_requantize(*saved, rstd, weight, y_scale, 16, E4M3))
    _, y_scale, _, *saved = ops.silu_mul_quantize(x, x, save_group_size=32, format="e5m2")
    requantized = ops.silu_mul_requantize(*saved, None, y_scale, 32, "e5m2")
    assert requantized.dtype == E5M2 and requantized.shape == (48, 5)
    assert_same_bits(requantized, torch.ops.coat.silu_mul_requantize(*saved, None, y_scale, 32, E5M2))


def test_requantize_nan_in_saved_inputs(device):
    """A NaN code in a saved input (positive or negative) gives the positive NaN code at that element only; a
    group saved with an Inf scale (its input held +-Inf) decodes to +-Inf and NaN (0 * Inf): with the
    forward's rstd = 0 for that row, RMSNorm's y_t is NaN over the group (the forward, from the exact x, had
    NaN at the Inf only)."""
    x = activations((6, 64), torch.bfloat16, seed=84)
    x[3, 40] = math.inf
    weight = torch.ones(64, dtype=torch.bfloat16)
    _, y_scale, y_t, x_saved, x_saved_scales, rstd = rmsnorm_forward(x, weight)
    assert rstd[3].item() == 0 and x_saved_scales[3, 2].item() == math.inf
    codes = x_saved.view(torch.uint8).clone()
    codes[1, 5], codes[2, 9] = 0x7F, 0xFF
    requantized = rmsnorm_requantize((codes.view(E4M3), x_saved_scales), rstd, weight, y_scale, device=device)
    nan = torch.zeros(64, 6, dtype=torch.bool)
    nan[5, 1] = nan[9, 2] = True
    nan[32:48, 3] = True
    out = requantized.view(torch.uint8)
    assert ((out & 0x7F) == 0x7F).equal(nan) and (out[nan] == 0x7F).all()
    assert out[:, 3][~nan[:, 3]].bitwise_and(0x7F).eq(0).all()  # the rest of the Inf row: x' * 0

    gate, up = gate_up((6, 64), torch.bfloat16, seed=85)
    _, silu_scale, _, gate_saved, gate_scales, up_saved, up_scales = silu_mul_forward(gate, up)
    gate_codes = gate_saved.view(torch.uint8).clone()
    gate_codes[4, 7] = 0xFF
    requantized = silu_mul_requantize((gate_codes.view(E4M3), gate_scales, up_saved, up_scales), None, silu_scale,
                                      device=device)
    out = requantized.view(torch.uint8)
    assert out[7, 4] == 0x7F and int(((out & 0x7F) == 0x7F).sum()) == 1



@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=str)
def test_silu_mul_requantize_special_gates(device, fp8):
    """The decoded gate is rounded to bf16 before silu, and its +-Inf and NaN behave as the forward's bf16 +-Inf
    and NaN gates: silu(+Inf) = +Inf (so y = +-Inf, saturated by E4M3, Inf in E5M2), silu(-Inf) = -Inf * 0 = NaN,
    silu(NaN) = NaN. Gates get there from a group saved with an Inf scale (nonzero codes: +-Inf; zero: NaN),
    from a finite g' past the largest bf16 (448 * 7.59e35 = 3.4003e38, finite in fp32, rounds to +-Inf), and from
    NaN codes. Every other element of those groups is still the bit-exact replay."""
    gate, up = gate_up((4, 64), torch.bfloat16, seed=88)
    _, y_scale, _, gate_saved, gate_scales, up_saved, up_scales = silu_mul_forward(gate, up, fp8=fp8)
    codes = gate_saved.view(torch.uint8).clone()
    scales = gate_scales.clone()
    scales[0, 0] = math.inf
    codes[0, :16] = torch.tensor([0x38, 0xB8, 0x00, 0x80, 0x7F, 0x7E, 0xFE, 0x01] * 2, dtype=torch.uint8)
    scales[1, 1] = 7.59e35
    codes[1, 16:32] = torch.tensor([0x7E, 0xFE, 0x7F, 0x38] * 4, dtype=torch.uint8)
    saved = (codes.view(E4M3), scales, up_saved, up_scales)
    requantized = silu_mul_requantize(saved, None, y_scale, fp8=fp8, device=device)
    g_decoded, u_decoded = ref.decode_saved(*saved[:2], 16), ref.decode_saved(*saved[2:], 16)
    g = ref.requantize_gate_f32(g_decoded)
    assert g_decoded[1, 16].item() < 3.4028e38 and g[1, 16].item() == math.inf and g[1, 17].item() == -math.inf
    y32 = ref.silu_mul_requantize_f32(g_decoded, u_decoded)
    check_requantized(requantized, y32, y_scale)
    # the forward's silu on the same bf16 gates
    forward_y32 = ref.silu_mul_f32(g.bfloat16().float(), u_decoded)
    assert_same_bits(torch.nan_to_num(y32, nan=0.0), torch.nan_to_num(forward_y32, nan=0.0), "y vs forward formula")
    assert y32.isnan().equal(forward_y32.isnan())
    out = requantized.view(torch.uint8).T
    special = g.isinf() | g.isnan()
    nonzero_up = u_decoded != 0
    positive_inf = (g == math.inf) & nonzero_up
    assert positive_inf.sum() >= 4 and ((g == -math.inf) | g.isnan()).sum() >= 8
    assert (out[(g == -math.inf) | g.isnan()] == 0x7F).all()
    top = 0x7E if fp8 == E4M3 else 0x7C  # +-448 saturated / +-Inf
    expected_top = torch.where(u_decoded[positive_inf] > 0, top, top | 0x80).to(torch.uint8)
    assert out[positive_inf].equal(expected_top)
    assert not (out[~special] == 0x7F).any()

# ----------------------------------------------------------------------------------------------------
# Backward and requantize from an FP4 or FP6 copy (saved_format 'fp4' or 'fp6'): each op reads a packed code as its exact
# E4M3 expansion, so its outputs equal, bit for bit, the same op's on ops.blocks_to_e4m3 of the copy, which the
# tests above hold to the float64 references. On CUDA run() also ties every output to the C core's.


def with_special_values(x: torch.Tensor) -> torch.Tensor:
    """x with a NaN, a zero and a tiny value in row 0 and an Inf in row 1: blocks with NaN and Inf scales."""
    x = x.clone()
    x[0, : min(3, x.shape[1])] = torch.tensor([float("nan"), 0.0, 1e-30][: min(3, x.shape[1])], dtype=x.dtype)
    if x.shape[0] > 1:
        x[1, -1] = float("inf")
    return x


@pytest.mark.parametrize("shape, group_size", BLOCK_SAVE_CASES, ids=str)
@pytest.mark.parametrize("dy_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_rmsnorm_ops_read_fp4_and_fp6_as_their_e4m3_expansion(device, fmt, shape, group_size, dy_dtype):
    x = with_special_values(activations(shape, torch.bfloat16, seed=shape[1] + 1))
    weight = (1 + 0.2 * torch.randn(shape[1], generator=torch.Generator().manual_seed(2))).bfloat16()
    _, y_scale, _, codes, scales, rstd = rmsnorm_forward(x, weight, group_size=group_size, save_format=fmt)
    expanded, _ = ops.blocks_to_e4m3(codes, scales, shape[1], fmt, group_size)
    dy = activations(shape, dy_dtype, seed=3, outliers=False)
    for residual in (None, activations(shape, torch.float32, seed=4, outliers=False)):
        from_packed = run(torch.ops.coat.rmsnorm_backward, dy, codes, scales, rstd, weight, group_size, residual, fmt,
                          device=device)
        from_e4m3 = run(torch.ops.coat.rmsnorm_backward, dy, expanded, scales, rstd, weight, group_size, residual,
                        device=device)
        for name, a, b in zip(("dx", "dweight"), from_packed, from_e4m3):
            assert_same_bits(a, b, f"{name} from {fmt} vs from its expansion (residual: {residual is not None})")
    for fp8 in (E4M3, E5M2):
        (from_packed,) = run(lambda *a: (torch.ops.coat.rmsnorm_requantize(*a),), codes, scales, rstd, weight,
                             y_scale, group_size, fp8, fmt, device=device)
        (from_e4m3,) = run(lambda *a: (torch.ops.coat.rmsnorm_requantize(*a),), expanded, scales, rstd, weight,
                           y_scale, group_size, fp8, device=device)
        assert_same_bits(from_packed, from_e4m3, f"{fp8} y_t from {fmt} vs from its expansion")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape, group_size", BLOCK_SAVE_CASES, ids=str)
@pytest.mark.parametrize("dy_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_silu_mul_ops_read_fp4_and_fp6_as_their_e4m3_expansion(device, fmt, shape, group_size, dy_dtype, activation):
    gate, up = gate_up(shape, torch.bfloat16, seed=shape[1] + 5)
    gate = with_special_values(gate)
    smooth = torch.exp(torch.randn(shape[1], generator=torch.Generator().manual_seed(6)))
    _, y_scale, _, gate_codes, gate_scales, up_codes, up_scales = silu_mul_forward(
        gate, up, smooth, group_size=group_size, save_format=fmt, activation=activation
    )
    gate_expanded, _ = ops.blocks_to_e4m3(gate_codes, gate_scales, shape[1], fmt, group_size)
    up_expanded, _ = ops.blocks_to_e4m3(up_codes, up_scales, shape[1], fmt, group_size)
    dy = activations(shape, dy_dtype, seed=7, outliers=False)
    for s in (None, smooth):
        from_packed = run(torch.ops.coat.silu_mul_backward, dy, gate_codes, gate_scales, up_codes, up_scales, s,
                          group_size, fmt, activation, device=device)
        from_e4m3 = run(torch.ops.coat.silu_mul_backward, dy, gate_expanded, gate_scales, up_expanded, up_scales, s,
                        group_size, "e4m3", activation, device=device)
        for name, a, b in zip(("dgate", "dup", "d_amax"), from_packed, from_e4m3):
            assert_same_bits(a, b, f"{name} from {fmt} vs from the expansion (smooth: {s is not None})")
        for fp8 in (E4M3, E5M2):
            (from_packed,) = run(lambda *a: (torch.ops.coat.silu_mul_requantize(*a),), gate_codes, gate_scales,
                                 up_codes, up_scales, s, y_scale, group_size, fp8, fmt, shape[1], activation,
                                 device=device)
            (from_e4m3,) = run(lambda *a: (torch.ops.coat.silu_mul_requantize(*a),), gate_expanded, gate_scales,
                               up_expanded, up_scales, s, y_scale, group_size, fp8, "e4m3", None, activation,
                               device=device)
            assert_same_bits(from_packed, from_e4m3,
                             f"{fp8} y_t from {fmt} vs from the expansion (smooth: {s is not None})")


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_fp4_and_fp6_python_wrappers(fmt):
    """coat.ops passes save_format and saved_format through; its FP4 and FP6 results equal the ops' own on the
    E4M3 expansion."""
    x = activations((5, 102), torch.bfloat16, seed=8)  # 102 codes: FP4 rows of 51 bytes, FP6 rows of 77
    weight = torch.ones(102, dtype=torch.bfloat16)
    _, y_scale, _, codes, scales, rstd = ops.rmsnorm_quantize(x, weight, save_format=fmt)
    assert codes.shape == (5, {"fp4": 51, "fp6": 77}[fmt]) and codes.dtype == torch.uint8
    expanded, _ = ops.blocks_to_e4m3(codes, scales, 102, fmt)
    assert_same_bits(ops.rmsnorm_backward(x, codes, scales, rstd, weight, saved_format=fmt)[0],
                     ops.rmsnorm_backward(x, expanded, scales, rstd, weight)[0], "wrapper dx")
    assert_same_bits(ops.rmsnorm_requantize(codes, scales, rstd, weight, y_scale, saved_format=fmt),
                     ops.rmsnorm_requantize(expanded, scales, rstd, weight, y_scale), "wrapper y_t")
    assert_same_bits(ops.silu_mul_backward(x, codes, scales, codes, scales, saved_format=fmt)[0],
                     ops.silu_mul_backward(x, expanded, scales, expanded, scales)[0], "wrapper dgate")
    assert_same_bits(
        ops.silu_mul_requantize(codes, scales, codes, scales, None, y_scale, saved_format=fmt, cols=102),
        ops.silu_mul_requantize(expanded, scales, expanded, scales, None, y_scale), "wrapper silu y_t",
    )
    for call in (lambda: ops.rmsnorm_backward(x, codes, scales, rstd, weight, saved_format="fp8"),
                 lambda: ops.silu_mul_requantize(codes, scales, codes, scales, None, y_scale, saved_format="int4")):
        with pytest.raises(ValueError, match="saved_format must be 'e4m3', 'fp4' or 'fp6', got '(fp8|int4)'"):
            call()


# ----------------------------------------------------------------------------------------------------
# Kernel paths: values and shapes that send the CUDA kernels down their other paths (the chunk-wise fast
# paths' fallbacks, the bf16 silu table's edges, several rounds of the persistent kernels); on CUDA every
# output is compared with the C core's bit for bit (run).

# Gates around the edges of the kernels' fast paths: the bf16 table holds 2^-24 <= |g| < 2^8 for silu, 2^-25 <= |g| <
# 2^7 for gelu_tanh; the computed sigmoid takes z(g) >= -80 and sends smaller ones through coat_exp's full range
# (-88.7, -103.3); gelu_tanh's z(g) reaches -80 near g = -9.67.
EDGE_GATES = [0.0, -0.0, 2.0**-24, -(2.0**-24), 2.0**-24 * (1 - 2.0**-8), 1e-30, 1e-39, 255.0, -255.0, 256.0,
              -256.0, 300.0, -80.0, -80.5, -81.0, -87.5, -88.5, -89.0, -103.0, -104.0, -200.0, 80.5, 88.5, 100.0,
              2.0**-25, -(2.0**-25), 127.5, 128.0, -128.0, -9.625, -9.6875, -9.75, -10.0]


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_silu_mul_gate_edges(device, dtype, activation):
    gate, up = gate_up((16, 256), dtype, seed=51)
    edges = torch.tensor(EDGE_GATES, dtype=torch.float64).to(dtype)
    positions = torch.randperm(gate.numel(), generator=torch.Generator().manual_seed(52))[: 8 * edges.numel()]
    flat = gate.reshape(-1).clone()
    flat[positions] = edges.repeat(8)
    gate.copy_(flat.view(gate.shape))
    outputs = silu_mul_forward(gate, up, device=device, activation=activation)
    check_silu_mul_forward(gate, up, None, outputs, activation=activation)
    dy = activations((16, 256), dtype, seed=53, outliers=False)
    run(torch.ops.coat.silu_mul_backward, dy, *outputs[3:], None, 16, "e4m3", activation, device=device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_tiny_groups(device, dtype):
    """Groups whose scales are under 2^-80 (values below about 1e-22), where the kernels divide instead of
    taking their fast quotient: half the rows of an RMSNorm input, and a SiLU*mul gate (and so y and its
    per-tensor scale)."""
    x = activations((9, 256), dtype, seed=54)
    x[::2] *= 1e-30
    weight = torch.ones(256, dtype=torch.bfloat16)
    y, y_scale, y_t, x_saved, x_saved_scales, rstd = rmsnorm_forward(x, weight, device=device)
    check_tied_to_quantize_group(x_saved, x_saved_scales, x, 16)
    gate, up = gate_up((9, 256), dtype, seed=55)
    gate *= 1e-23
    outputs = silu_mul_forward(gate, up, device=device)
    check_tied_to_quantize_tensor(outputs[0], outputs[1], ref.silu_mul_f32(gate.float(), up.float()), outputs[2])
    check_tied_to_quantize_group(outputs[3], outputs[4], gate, 16)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_backward_special_values(device, dtype, activation):
    """NaN / Inf in the saved inputs (NaN codes) and in dy, and dy so small that the gradients are subnormal
    in dy's dtype (the kernels' 16-bit stores round them in hardware)."""
    x = activations((8, 512), torch.bfloat16, seed=56)
    x[1, 3], x[2, 40], x[3, 100] = math.nan, math.inf, -math.inf
    weight = (1 + 0.2 * torch.randn(512, generator=torch.Generator().manual_seed(57))).bfloat16()
    _, _, _, x_saved, x_saved_scales, rstd = rmsnorm_forward(x, weight, transpose=False)
    dy = activations((8, 512), dtype, seed=58, outliers=False)
    dy[4, 7], dy[5, 9] = math.nan, math.inf
    dy[6] *= 1e-38 if dtype != torch.float16 else 1e-6
    run(torch.ops.coat.rmsnorm_backward, dy, x_saved, x_saved_scales, rstd, weight, 16, device=device)

    gate, up = gate_up((8, 512), torch.bfloat16, seed=59)
    gate[1, 3], up[2, 40], gate[3, 100] = math.nan, math.inf, -math.inf
    saved = silu_mul_forward(gate, up, transpose=False)[3:]
    run(torch.ops.coat.silu_mul_backward, dy, *saved, None, 16, "e4m3", activation, device=device)


def several_rounds(rows_per_sm: int) -> int:
    """Rows enough for three rounds of a persistent kernel that takes at most rows_per_sm rows per SM and
    round on this GPU: only then does a block walk several rows or tiles with the next ones in flight."""
    return 3 * torch.cuda.get_device_properties(0).multi_processor_count * rows_per_sm + 5


@pytest.mark.parametrize("cols", [256, 4096])
def test_rmsnorm_several_rounds(cuda_device, cols):
    """Every block of the persistent kernels takes several rounds: the statistics pass reduces at most
    8 blocks x 256 / L rows per SM and round, the second pass 8 blocks x 64 x 64 / cols rows; the backward
    walks several rows per slice."""
    rows = several_rounds(max(8 * 256 // ref.rmsnorm_lanes(cols), 8 * 64 * 64 // cols))
    x = activations((rows, cols), torch.bfloat16, seed=cols)
    weight = (1 + 0.2 * torch.randn(cols, generator=torch.Generator().manual_seed(60))).float()
    _, _, _, x_saved, x_saved_scales, rstd = rmsnorm_forward(x, weight, device=cuda_device)
    assert ref.rmsnorm_backward_rows_per_slice(rows, cols) > 2
    dy = activations((rows, cols), torch.bfloat16, seed=cols + 1, outliers=False)
    run(torch.ops.coat.rmsnorm_backward, dy, x_saved, x_saved_scales, rstd, weight, 16, device=cuda_device)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_silu_mul_several_rounds(cuda_device, activation):
    """Blocks of 8 rows over 2 segments of 512 columns, at most 8 blocks per SM: 32 rows per SM and round."""
    gate, up = gate_up((several_rounds(32), 1000), torch.bfloat16, seed=61)
    outputs = silu_mul_forward(gate, up, device=cuda_device, activation=activation)
    dy = activations(tuple(gate.shape), torch.bfloat16, seed=62, outliers=False)
    run(torch.ops.coat.silu_mul_backward, dy, *outputs[3:], None, 16, "e4m3", activation, device=cuda_device)


# ----------------------------------------------------------------------------------------------------
# opcheck and errors


def test_opcheck(device):
    x = on_device(activations((3, 5, 64), torch.bfloat16, seed=41), device)
    weight = on_device(torch.ones(64, dtype=torch.bfloat16), device)
    smooth = on_device(torch.rand(64) + 0.5, device)
    torch.library.opcheck(torch.ops.coat.rmsnorm_quantize.default, (x, weight, EPS, 16, 128, E4M3, True))
    for s, transpose in ((None, False), (smooth, True)):
        torch.library.opcheck(torch.ops.coat.silu_mul_quantize.default, (x, x * 2, s, 32, 64, E5M2, transpose))
        torch.library.opcheck(torch.ops.coat.silu_mul_quantize.default,
                              (x, x * 2, s, 32, 64, E5M2, transpose, "e4m3", "gelu_tanh"))
    # test_schema compares the inputs before and after the call with torch.allclose, which torch does not
    # implement for FP8 tensors, and the backward ops take FP8 inputs; the other checks all run.
    fp8_input_checks = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    _, _, _, x_saved, x_saved_scales, rstd = torch.ops.coat.rmsnorm_quantize(x, weight, EPS, 16, 128, E4M3, False)
    for residual in (None, x.float()):
        torch.library.opcheck(
            torch.ops.coat.rmsnorm_backward.default, (x, x_saved, x_saved_scales, rstd, weight, 16, residual),
            test_utils=fp8_input_checks,
        )
    for s, activation in ((None, "silu"), (smooth, "silu"), (smooth, "gelu_tanh")):
        torch.library.opcheck(
            torch.ops.coat.silu_mul_backward.default,
            (x, x_saved, x_saved_scales, x_saved, x_saved_scales, s, 16, "e4m3", activation),
            test_utils=fp8_input_checks,
        )
    y_scale = on_device(torch.tensor(0.01), device)
    torch.library.opcheck(
        torch.ops.coat.rmsnorm_requantize.default, (x_saved, x_saved_scales, rstd, weight, y_scale, 16, E4M3),
        test_utils=fp8_input_checks,
    )
    for s, fp8, activation in ((None, E4M3, "silu"), (smooth, E5M2, "silu"), (smooth, E4M3, "gelu_tanh")):
        torch.library.opcheck(
            torch.ops.coat.silu_mul_requantize.default,
            (x_saved, x_saved_scales, x_saved, x_saved_scales, s, y_scale, 16, fp8, "e4m3", None, activation),
            test_utils=fp8_input_checks,
        )



@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_opcheck_fp4_and_fp6_copies(device, fmt):
    """The forward ops saving FP4 or FP6, and the backward and requantize ops reading them (the packed copies are
    uint8, which every check can compare). H = 66 is not a multiple of 4 or 8: FP6 rows end with two codes in their
    last three-byte word."""
    x = on_device(activations((3, 5, 66), torch.bfloat16, seed=42), device)
    weight = on_device(torch.ones(66, dtype=torch.bfloat16), device)
    smooth = on_device(torch.rand(66) + 0.5, device)
    torch.library.opcheck(torch.ops.coat.rmsnorm_quantize.default, (x, weight, EPS, 16, 128, E4M3, True, fmt))
    torch.library.opcheck(torch.ops.coat.silu_mul_quantize.default, (x, x * 2, smooth, 32, 64, E5M2, False, fmt))
    _, _, _, packed, packed_scales, rstd = torch.ops.coat.rmsnorm_quantize(x, weight, EPS, 16, 128, E4M3, False, fmt)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, {"fp4": 33, "fp6": 50}[fmt])
    y_scale = on_device(torch.tensor(0.01), device)
    for residual in (None, x.float()):
        torch.library.opcheck(torch.ops.coat.rmsnorm_backward.default,
                              (x, packed, packed_scales, rstd, weight, 16, residual, fmt))
    for activation in ACTIVATIONS:
        torch.library.opcheck(torch.ops.coat.silu_mul_backward.default,
                              (x, packed, packed_scales, packed, packed_scales, smooth, 16, fmt, activation))
    torch.library.opcheck(torch.ops.coat.rmsnorm_requantize.default,
                          (packed, packed_scales, rstd, weight, y_scale, 16, E4M3, fmt))
    for s, fp8, activation in ((None, E5M2, "silu"), (smooth, E4M3, "silu"), (smooth, E5M2, "gelu_tanh")):
        torch.library.opcheck(torch.ops.coat.silu_mul_requantize.default,
                              (packed, packed_scales, packed, packed_scales, s, y_scale, 16, fp8, fmt, 66, activation))


def test_errors():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    rmsnorm = torch.ops.coat.rmsnorm_quantize
    silu_mul = torch.ops.coat.silu_mul_quantize
    cases = [
        (lambda: rmsnorm(x.int(), w, EPS, 16, 128, E4M3, False), "x must be float32, bfloat16 or float16"),
        (lambda: rmsnorm(x.T, w, EPS, 16, 128, E4M3, False), "last dimension must be contiguous"),
        (lambda: rmsnorm(x, w, EPS, 8, 128, E4M3, False), "save_group_size must be 16, 32, 64 or 128, got 8"),
        (lambda: rmsnorm(x, w, EPS, 16, 256, E4M3, False), "amax_group_size must be 16, 32, 64 or 128, got 256"),
        (lambda: rmsnorm(x, w, EPS, 16, 128, torch.float16, False), "fp8_dtype must be torch.float8_e4m3fn"),
        (lambda: rmsnorm(x, w[:32], EPS, 16, 128, E4M3, False), r"weight must have shape \[64\]"),
        (lambda: rmsnorm(x, w, -1.0, 16, 128, E4M3, False), "eps must be finite and >= 0"),
        (lambda: rmsnorm(torch.ones(2, 40000), torch.ones(40000), EPS, 16, 128, E4M3, False), "between 1 and 32768"),
        (lambda: silu_mul(x, x[:, :32], None, 16, 128, E4M3, False), "gate and up must have the same shape"),
        (lambda: silu_mul(x, x.float(), None, 16, 128, E4M3, False), "gate and up must have the same dtype"),
        (lambda: silu_mul(x, x, torch.ones(64, dtype=torch.bfloat16), 16, 128, E4M3, False), "smooth_scale must be float32"),
        (lambda: silu_mul(x, x, torch.ones(32), 16, 128, E4M3, False), r"smooth_scale must have shape \[64\]"),
    ]
    _, _, _, saved, scales, rstd = rmsnorm(x, w, EPS, 16, 128, E4M3, False)
    backward = torch.ops.coat.rmsnorm_backward
    cases += [
        (lambda: backward(x[:2], saved, scales, rstd, w, 16), "x_saved has shape"),
        (lambda: backward(x, saved.view(torch.uint8), scales, rstd, w, 16), "x_saved must be torch.float8_e4m3fn"),
        (lambda: backward(x, saved, scales, rstd, w, 32), r"x_saved_scales must have shape \[4, 2\]"),
        (lambda: backward(x, saved, scales, rstd[:2], w, 16), "one value per row"),
        (lambda: backward(x, saved, scales, rstd, w, 16, x[:2]), "residual has shape .* but dy has shape"),
        (lambda: backward(x, saved, scales, rstd, w, 16, x.T.contiguous().T),
         r"residual must be contiguous; call .contiguous\(\)"),
        (lambda: backward(x, saved, scales, rstd, w, 16, x.int()), "residual must be float32, bfloat16 or float16"),
        (lambda: torch.ops.coat.silu_mul_backward(x, saved, scales, saved.T, scales, None, 16), "up_saved has shape"),
    ]
    format_choice = r"must be 'e4m3', 'fp4' or 'fp6', got"
    cases += [
        (lambda: rmsnorm(x, w, EPS, 16, 128, E4M3, False, "fp8"), rf"coat\.rmsnorm_quantize: save_format {format_choice} 'fp8'"),
        (lambda: silu_mul(x, x, None, 16, 128, E4M3, False, "FP4"), rf"coat\.silu_mul_quantize: save_format {format_choice} 'FP4'"),
        (lambda: backward(x, saved, scales, rstd, w, 16, None, "int4"), rf"coat\.rmsnorm_backward: saved_format {format_choice} 'int4'"),
        (lambda: torch.ops.coat.silu_mul_backward(x, saved, scales, saved, scales, None, 16, ""),
         rf"coat\.silu_mul_backward: saved_format {format_choice} ''"),
    ]
    y_scale = torch.tensor(0.01)
    requantize = torch.ops.coat.rmsnorm_requantize
    silu_requantize = torch.ops.coat.silu_mul_requantize
    cases += [
        (lambda: requantize(saved.view(torch.uint8), scales, rstd, w, y_scale, 16, E4M3),
         "x_saved must be torch.float8_e4m3fn"),
        (lambda: requantize(saved.T, scales, rstd, w, y_scale, 16, E4M3), "x_saved must be contiguous"),
        (lambda: requantize(saved, scales, rstd, w, y_scale, 32, E4M3), r"x_saved_scales must have shape \[4, 2\]"),
        (lambda: requantize(saved, scales, rstd, w, y_scale, 8, E4M3), "save_group_size must be 16, 32, 64 or 128"),
        (lambda: requantize(saved, scales, rstd[:2], w, y_scale, 16, E4M3), "one value per row"),
        (lambda: requantize(saved, scales, rstd, w[:32], y_scale, 16, E4M3), r"weight must have shape \[64\]"),
        (lambda: requantize(saved, scales, rstd, w.int(), y_scale, 16, E4M3), "weight must be float32, bfloat16"),
        (lambda: requantize(saved, scales, rstd, w, torch.ones(2), 16, E4M3), "y_scale must be a float32 tensor with one"),
        (lambda: requantize(saved, scales, rstd, w, y_scale.double(), 16, E4M3), "y_scale must be a float32 tensor"),
        (lambda: requantize(saved, scales, rstd, w, y_scale, 16, torch.bfloat16), "fp8_dtype must be torch.float8_e4m3fn"),
        (lambda: silu_requantize(saved, scales, saved[:2], scales, None, y_scale, 16, E4M3),
         "up_saved has shape .* but gate_saved has shape"),
        (lambda: silu_requantize(saved, scales, saved, scales[:2], None, y_scale, 16, E4M3),
         r"up_scales must have shape \[4, 4\]"),
        (lambda: silu_requantize(saved, scales, saved, scales, torch.ones(32), y_scale, 16, E4M3),
         r"smooth_scale must have shape \[64\]"),
        (lambda: silu_requantize(saved, scales, saved, scales, None, torch.empty(0), 16, E4M3),
         "y_scale must be a float32 tensor with one element"),
        (lambda: silu_requantize(saved, scales, saved, scales, None, y_scale, 16, E4M3, "e4m3", 63),
         "cols=63 but gate_saved has 64 columns"),
        (lambda: requantize(saved, scales, rstd, w, y_scale, 16, E4M3, "fp8"),
         rf"coat\.rmsnorm_requantize: saved_format {format_choice} 'fp8'"),
        (lambda: silu_requantize(saved, scales, saved, scales, None, y_scale, 16, E4M3, "fp5", 64),
         rf"coat\.silu_mul_requantize: saved_format {format_choice} 'fp5'"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


# Bytes of a packed row of 64, 32, 16 and 66 codes: FP4 ceil(cols / 2), FP6 ceil(3 cols / 4).
PACKED_BYTES = {"fp4": {64: 32, 32: 16, 16: 8, 66: 33}, "fp6": {64: 48, 32: 24, 16: 12, 66: 50}}


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_errors_with_fp4_and_fp6_copies(fmt):
    """Each packed format's checks: an E4M3 reading of packed codes, a packed reading of E4M3 codes, packed shapes
    (the message names the format), a copy of the other packed format, and silu_mul_requantize's cols."""
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    y_scale = torch.tensor(0.01)
    other = {"fp4": "fp6", "fp6": "fp4"}[fmt]
    nbytes = PACKED_BYTES[fmt]
    rmsnorm, backward = torch.ops.coat.rmsnorm_quantize, torch.ops.coat.rmsnorm_backward
    requantize, silu_requantize = torch.ops.coat.rmsnorm_requantize, torch.ops.coat.silu_mul_requantize
    _, _, _, saved, scales, rstd = rmsnorm(x, w, EPS, 16, 128, E4M3, False)
    _, _, _, packed, packed_scales, _ = rmsnorm(x, w, EPS, 16, 128, E4M3, False, fmt)
    _, _, _, other_packed, _, _ = rmsnorm(x, w, EPS, 16, 128, E4M3, False, other)
    assert packed.shape == (4, nbytes[64])
    cases = [
        (lambda: backward(x, packed, packed_scales, rstd, w, 16),
         "x_saved must be torch.float8_e4m3fn, as the forward op saves it, got Byte; for packed FP4 or FP6 codes pass "
         "the saved_format the forward op saved them in"),
        (lambda: backward(x, saved, scales, rstd, w, 16, None, fmt),
         rf"with saved_format='{fmt}' x_saved must be torch\.uint8 \(packed codes, as the forward op saves them with "
         rf"save_format='{fmt}'\), got Float8_e4m3fn"),
        (lambda: backward(x, packed[:, :16], packed_scales, rstd, w, 16, None, fmt),
         rf"x_saved has shape \[4, 16\] but the {fmt} codes of an input of shape \[4, 64\] \(from dy\) have shape "
         rf"\[4, {nbytes[64]}\]"),
        (lambda: backward(x, other_packed, packed_scales, rstd, w, 16, None, fmt),
         rf"x_saved has shape \[4, {PACKED_BYTES[other][64]}\] but the {fmt} codes of an input of shape \[4, 64\]"),
        (lambda: torch.ops.coat.silu_mul_backward(x, packed, packed_scales, saved, scales, None, 16, fmt),
         rf"with saved_format='{fmt}' up_saved must be torch\.uint8"),
        (lambda: requantize(packed, packed_scales, rstd, w[:32], y_scale, 16, E4M3, fmt),
         rf"x_saved has shape \[4, {nbytes[64]}\] but the {fmt} codes of an input of shape \[4, 32\] \(from weight\) "
         rf"have shape \[4, {nbytes[32]}\]"),
        (lambda: requantize(packed, packed_scales, rstd, w[None], y_scale, 16, E4M3, fmt), r"weight must have shape \[H\]"),
        (lambda: silu_requantize(packed, packed_scales, packed, packed_scales, None, y_scale, 16, E4M3, fmt),
         rf"with saved_format='{fmt}' pass cols, the width of gate and up"),
        (lambda: silu_requantize(packed, packed_scales, packed, packed_scales, None, y_scale, 16, E4M3, fmt, 66),
         rf"the {fmt} codes of an input of shape \[4, 66\] \(from cols\) have shape \[4, {nbytes[66]}\]"),
        (lambda: silu_requantize(packed, packed_scales, packed[:, :nbytes[16]], packed_scales, None, y_scale, 16, E4M3,
                                 fmt, 64),
         rf"up_saved has shape \[4, {nbytes[16]}\] but the {fmt} codes of an input of shape \[4, 64\] \(from gate_saved\)"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


def test_rmsnorm_backward_residual_on_another_device(cuda_device):
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    weight = torch.ones(64, dtype=torch.bfloat16)
    _, _, _, saved, scales, rstd = torch.ops.coat.rmsnorm_quantize(x, weight, EPS, 16, 128, E4M3, False)
    on_gpu = [t.to(cuda_device) for t in (x, saved, scales, rstd, weight)]
    with pytest.raises(RuntimeError, match="residual is on cpu but the input is on cuda"):
        torch.ops.coat.rmsnorm_backward(*on_gpu, 16, x)
