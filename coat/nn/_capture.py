"""The switch between coat.report and the FP8 layers' autograd Functions.

While a :class:`coat.report.QuantizationReport` captures a step, ``active`` is that report, and each
Function's forward asks it for a *site* (the report plus the module the call runs in), keeps it on its ctx
for backward, and hands it to the helpers that quantize, which record the unquantized tensor beside its FP8
copy. The report measures what a forward or backward recorded when it returns (``measures_records``), in
one native call rather than one per tensor. Outside a capture ``active`` is None: a forward or backward pays
two reads of it and nothing else runs, and torch.compile guards on it like on any global, so a compiled
model traces without a graph break.
"""
from __future__ import annotations

import functools

active = None  # the QuantizationReport whose capture is in progress


def forward_site():
    """The site a Function's forward records into, or None outside a capture."""
    return None if active is None else active._site()


def backward_site(ctx):
    """The site the forward of ``ctx`` recorded into, while that capture is still in progress; None
    otherwise (a backward after its capture ended, or of a forward that ran outside one, records nothing)."""
    if active is None:
        return None
    site = ctx.report_site
    return site if site is not None and site.report is active else None


def measures_records(method):
    """Wraps a Function's forward or backward: what it recorded is measured when it returns, while the tensors
    it recorded are still the values it quantized."""
    @functools.wraps(method)
    def measured(*args, **kwargs):
        result = method(*args, **kwargs)
        if active is not None:
            active._flush()
        return result

    return measured
