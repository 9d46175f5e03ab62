"""coat.nn: FP8 layers. ``Linear`` is a drop-in for ``torch.nn.Linear``; :mod:`coat.nn.functional` holds
the autograd Functions, which decide what is saved for backward."""
from coat.nn import functional
from coat.nn.config import FP8Config
from coat.nn.modules import Linear

__all__ = ["FP8Config", "Linear", "functional"]
