"""The transformers releases selfspec is tested with, and how the installed one takes a KV cache.

transformers renamed the forward argument `past_key_values` to `cache` in 5.24; 5.23 and older
take only `past_key_values`, swallow `cache` in `**kwargs` and run without a cache: no error,
wrong tokens.
So the argument name is read once from the installed `Ministral3Model.forward`, the model checks
after every cached forward that the cache really grew (`model.py`), and `import selfspec` refuses
a release outside the range that `benchmarks/compat.sh` runs the exactness tests under.
"""

from __future__ import annotations

import inspect
import os
import warnings

# Keep in step with pyproject.toml and benchmarks/compat.sh (tests/test_versions.py checks both).
TRANSFORMERS_MIN = "5.4.0"  # oldest release the exactness tests pass under (5.3.0: configs are no dataclasses yet)
TRANSFORMERS_BELOW = "5.25"  # first release not tested (5.24.0 is the newest tested)
TRANSFORMERS_RANGE = f">={TRANSFORMERS_MIN},<{TRANSFORMERS_BELOW}"
OVERRIDE_ENV = "SELFSPEC_ALLOW_UNTESTED_TRANSFORMERS"


def parse(version: str) -> tuple[int, ...]:
    """Release numbers of a version string, ignoring pre/dev/local tails.

    Example: parse("5.24.0") == (5, 24, 0); parse("5.25.0.dev0") == (5, 25, 0); parse("5.3") == (5, 3).
    """
    out = []
    for part in version.split("+")[0].split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
        if len(digits) != len(part):
            break
    return tuple(out)


def in_range(version: str, lo: str = TRANSFORMERS_MIN, below: str = TRANSFORMERS_BELOW) -> bool:
    """lo <= version < below, by release numbers. Example: in_range("5.19.0") is True, in_range("5.18.0") is False."""
    v = parse(version)
    return parse(lo) <= v < parse(below)


def check_transformers(version: str | None = None) -> None:
    """Raise ImportError naming the tested range when transformers is outside it.

    Setting SELFSPEC_ALLOW_UNTESTED_TRANSFORMERS=1 turns the error into a warning (the dropped-cache
    guard in the model still stands).
    """
    if version is None:
        import transformers

        version = transformers.__version__
    if in_range(version):
        return
    msg = (f"selfspec is tested with transformers {TRANSFORMERS_RANGE} (benchmarks/compat.sh), but "
           f"transformers {version} is installed; install a release in that range, e.g. "
           f"pip install 'transformers{TRANSFORMERS_RANGE}'")
    if os.environ.get(OVERRIDE_ENV) == "1":
        warnings.warn(msg + f" ({OVERRIDE_ENV}=1: continuing untested)", stacklevel=2)
        return
    raise ImportError(msg + f" (or set {OVERRIDE_ENV}=1 to run untested)")


def cache_argument(forward) -> str:
    """The name under which `forward` takes the KV cache: 'cache' (5.24 on) or 'past_key_values'.

    Example: for `def forward(self, input_ids, past_key_values=None, **kw)` it is 'past_key_values'.
    """
    params = inspect.signature(forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise ImportError(f"{forward.__qualname__} takes neither `cache` nor `past_key_values`; "
                      f"selfspec supports transformers {TRANSFORMERS_RANGE}")
