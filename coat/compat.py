"""The transformers releases coat.convert supports, and the check it runs before it converts a model.

This is the range's one source: pyproject.toml's extras, the README and the docs state it too
(tests/test_nn_llama.py checks that they agree), and .ci/run tests both ends of it. docs/design.md says how to
move the newest end (scripts/check_newest_transformers.sh).
"""
from __future__ import annotations

import warnings

TRANSFORMERS_OLDEST = "5.17.0"  # the oldest release coat supports and tests
TRANSFORMERS_NEWEST = "5.25.0"  # the newest release coat is tested with
TRANSFORMERS_REQUIREMENT = f"transformers>={TRANSFORMERS_OLDEST},<={TRANSFORMERS_NEWEST}"


def check_transformers_version() -> None:
    """Raises an ImportError where the installed transformers is older than coat supports, and warns where it
    is newer than coat is tested with: a converted decoder layer runs coat's own copy of the stock layer's
    forward, which a newer release may call with arguments, or expect steps, that the copy does not know."""
    import transformers
    from packaging.version import Version

    installed = Version(transformers.__version__)
    if installed < Version(TRANSFORMERS_OLDEST):
        raise ImportError(
            f"coat.convert needs transformers {TRANSFORMERS_OLDEST} or newer, and {installed} is installed: "
            f"pip install '{TRANSFORMERS_REQUIREMENT}'"
        )
    if installed > Version(TRANSFORMERS_NEWEST):
        warnings.warn(
            f"coat.convert is tested with transformers {TRANSFORMERS_OLDEST} to {TRANSFORMERS_NEWEST}, and "
            f"{installed} is installed. Converted decoder layers mirror the stock forward of the tested releases, "
            f"which a newer one may have changed (5.24 renamed the KV cache argument): check that a converted "
            f"model's logits through the KV cache match its full forward, or pip install '{TRANSFORMERS_REQUIREMENT}'",
            stacklevel=3,
        )
