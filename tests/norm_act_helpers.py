"""Shared by the tests of the fused non-linear layers (tests/test_norm_act*.py, test_norm_weight_offset.py,
test_rmsnorm_save.py): bit comparisons, the op runners that tie CUDA to the C core, input generators, and the
checks that hold the ops to the bounds tests/test_norm_act.py's module docstring states."""
from __future__ import annotations

import math

import torch

import reference_norm_act as ref
from coat import ops

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-6
BLOCK_FORMATS = ("fp4", "fp6")  # the packed, block-scaled saved formats
ACTIVATIONS = ops.ACTIVATIONS


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


# Widths with whole chunks, a short chunk (1000 % 16 == 8), rows that end inside a packed byte (FP4: the odd widths 7
# and 13) or inside a packed three-byte word (FP6: 13, 50 and 7 leave 1, 2 and 3 codes in the last word), one
# narrower than a chunk; group sizes 16 to 128.
# G = 64 and 128 with rows cut inside a group: SiLU*mul's backward shares FP4 gates' factors across those groups
BLOCK_SAVE_CASES = [((97, 2048), 16), ((33, 1000), 128), ((5, 100), 16), ((3, 7), 16), ((4097, 176), 32),
                    ((9, 50), 32), ((4, 13), 16), ((9, 300), 128), ((6, 1100), 64)]


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


def canonical_nan(t: torch.Tensor) -> torch.Tensor:
    """t with every NaN the canonical quiet NaN (torch's own: 0x7FC00000, bf16 0x7FC0, fp16 0x7E00)."""
    return torch.where(t.isnan(), torch.full_like(t, math.nan), t)


def gate_up(shape, dtype, seed):
    """gate and up as the two halves of one [..., 2I] GEMM output: row-strided views."""
    fused = activations((*shape[:-1], 2 * shape[-1]), dtype, seed=seed)
    return fused[..., : shape[-1]], fused[..., shape[-1] :]


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


# Backward and requantize from an FP4 or FP6 copy: inputs whose blocks have NaN and Inf scales.


def with_special_values(x: torch.Tensor) -> torch.Tensor:
    """x with a NaN, a zero and a tiny value in row 0 and an Inf in row 1: blocks with NaN and Inf scales."""
    x = x.clone()
    x[0, : min(3, x.shape[1])] = torch.tensor([float("nan"), 0.0, 1e-30][: min(3, x.shape[1])], dtype=x.dtype)
    if x.shape[0] > 1:
        x[1, -1] = float("inf")
    return x


def several_rounds(rows_per_sm: int) -> int:
    """Rows enough for three rounds of a persistent kernel that takes at most rows_per_sm rows per SM and
    round on this GPU: only then does a block walk several rows or tiles with the next ones in flight."""
    return 3 * torch.cuda.get_device_properties(0).multi_processor_count * rows_per_sm + 5
