"""coat's optimizers: AdamW with FP8 moments (COAT's dynamic range expansion)."""
from coat.optim.adamw import AdamW

__all__ = ["AdamW"]
