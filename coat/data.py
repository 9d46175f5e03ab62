"""Real text that ships with every Python, for examples, benchmarks and tests that must not download."""
from __future__ import annotations

import os
import sysconfig

import torch


def stdlib_tokens(max_bytes: int) -> torch.Tensor:
    """Byte-level tokens (int64 in 0..255) of the standard library's sources, read from this Python's
    installation in file-name order, at most ``max_bytes`` of them: real text on every machine, with no
    download and no tokenizer."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and total < max_bytes:
            with open(os.path.join(root, name), "rb") as f:
                chunks.append(f.read())
            total += len(chunks[-1])
    return torch.frombuffer(bytearray(b"".join(chunks)[:max_bytes]), dtype=torch.uint8).long()
