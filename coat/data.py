"""Real text that ships with every Python, for examples, benchmarks and tests that must not download."""
from __future__ import annotations

import os
import sysconfig

import torch


def _stdlib_sources() -> list[str]:
    """The standard library's .py files: the top level in name order, then each package's files, walked in
    name order (site-packages excluded). Top level first, so that small reads are the same short modules
    everywhere."""
    root = sysconfig.get_paths()["stdlib"]
    top = sorted(name for name in os.listdir(root) if name.endswith(".py"))
    paths = [os.path.join(root, name) for name in top]
    for directory in sorted(name for name in os.listdir(root) if os.path.isdir(os.path.join(root, name))):
        if directory == "site-packages":
            continue
        for parent, children, files in os.walk(os.path.join(root, directory)):
            children.sort()
            paths += [os.path.join(parent, name) for name in sorted(files) if name.endswith(".py")]
    return paths


def stdlib_tokens(max_bytes: int | None = None) -> torch.Tensor:
    """Byte-level tokens (int64 in 0..255) of the standard library's Python sources, at most ``max_bytes`` of
    them (None: all, about 30 MB): real text on every machine, with no download and no tokenizer. The
    exact text depends on the Python version."""
    chunks, total = [], 0
    for path in _stdlib_sources():
        if max_bytes is not None and total >= max_bytes:
            break
        with open(path, "rb") as f:
            chunks.append(f.read())
        total += len(chunks[-1])
    data = b"".join(chunks)
    if max_bytes is not None:
        data = data[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
