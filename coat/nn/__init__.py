"""coat.nn: FP8 layers. ``Linear`` is a drop-in for ``torch.nn.Linear``, ``RMSNorm`` and ``SwiGLUMLP`` for
transformers' LlamaRMSNorm and LlamaMLP, ``MLP`` for the non-gated MLPs of vision towers (CLIPMLP, SiglipMLP);
:mod:`coat.nn.functional` holds the autograd Functions, which decide what is saved for backward, including the
decoder blocks that coat.convert wires into a model. ``FP8Weight`` is a weight that arrives in FP8
(coat.distributed.fp8_all_gather). ``saved_in_fp4`` keeps every 16-bit saved activation in FP4, the uniform-4-bit
ablation."""
from coat.nn import functional
from coat.nn.config import FP8Config
from coat.nn.fp8_weight import FP8Weight
from coat.nn.modules import MLP, Linear, RMSNorm, SwiGLUMLP
from coat.nn.saved_fp4 import saved_in_fp4

__all__ = ["FP8Config", "FP8Weight", "Linear", "MLP", "RMSNorm", "SwiGLUMLP", "functional", "saved_in_fp4"]
