"""scaled_dot_product_attention without cuDNN's kernel, where its backward can turn finite gradients into NaN.

torch's builds with cuDNN 9.15.1 or later try cuDNN's attention first on Hopper. Its backward overflows where a
query row's logsumexp is below -ln(FLT_MAX) ~ -88.7 (every logit of the row very negative) and the keys are 64
(mod 128) long: the padded half of the last 128-key tile enters exp(0 - lse) unmasked, and the query gradient
becomes Inf/NaN (pytorch#196678). Random tests do not see it (their logsumexp is about log(keys) > 0). Measured
on an H100 (torch 2.11, cuDNN 9.19: ``scripts/check_sdpa_backward.py``): NaN at 64 and 192 keys, with and
without a mask, from cuDNN's kernel, the one torch chose; finite from FlashAttention's, the memory-efficient one
and the math one. examples/train_vlm.py hit it after 1,000-1,500 steps, in BF16 as with coat, in the vision
tower's attention over windows of 8 x 8 patches (64 keys, Qwen2.5-VL's own window size).

:func:`sdpa_without_cudnn` is the context that coat.convert puts such attention under: the vision towers of the
vision-language models (:func:`coat.nn.vision.avoid_cudnn_attention`; non-causal, over windows or pictures of
any length) and the decoder layers' attention when it takes a mask tensor (padding, packed sequences). Causal
attention without a mask (``is_causal=True``, coat's unpadded path) keeps cuDNN: it masks the tile's padding.
"""
from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# The kernels other than cuDNN's, with the switch that tells whether each is enabled.
_OTHER_KERNELS = {
    SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
    SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
    SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled,
}


@torch.compiler.assume_constant_result  # reading the switches would break the graph; read when traced
def enabled_kernels_without_cudnn() -> list[SDPBackend]:
    """The SDPA kernels enabled now (by torch's switches or an enclosing ``sdpa_kernel``), cuDNN's left out."""
    return [kernel for kernel, enabled in _OTHER_KERNELS.items() if enabled()]


def sdpa_without_cudnn() -> contextlib.AbstractContextManager:
    """A context in which scaled_dot_product_attention chooses among the kernels enabled when it is entered (under
    torch.compile, when it is traced), less cuDNN's. Where cuDNN's is the only one enabled, it changes nothing: the
    caller chose it."""
    kernels = enabled_kernels_without_cudnn()
    return sdpa_kernel(kernels) if kernels else contextlib.nullcontext()
