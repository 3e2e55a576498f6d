"""What an optimizer reads from a :class:`frugal_kernels.Governor` reallocation."""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["suggested_factor"]


def suggested_factor(decision: Any, *keys: str) -> float:
    """The first of ``keys`` present in ``decision.suggestion`` (1.0, no change, if none is).

    A factor must be a finite positive number; anything else is refused before the
    optimizer changes, so a bad decision cannot leave a schedule half-applied or NaN.
    """
    suggestion = getattr(decision, "suggestion", None) or {}
    for key in keys:
        if key in suggestion:
            factor = suggestion[key]
            if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
                raise TypeError(f"the governor's suggestion[{key!r}] must be a number, "
                                f"got {factor!r}")
            if not math.isfinite(factor) or factor <= 0:
                raise ValueError(f"the governor's suggestion[{key!r}] must be a finite "
                                 f"positive factor, got {factor!r}")
            return float(factor)
    return 1.0
