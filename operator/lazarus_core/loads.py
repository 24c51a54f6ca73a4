"""Expert loads as users give them (``--loads``, a simulator config): the input of replica
allocation (``allocation.py``)."""
from __future__ import annotations

import json
import math
from pathlib import Path


def parse_loads(spec: str, experts: int, layers: int) -> list[list[float]]:
    if spec.startswith("zipf:"):
        try:
            s = float(spec[5:])
        except ValueError:
            raise ValueError(f"--loads: zipf skew must be a number, got {spec[5:]!r}") from None
        if not s >= 0:  # NaN too
            raise ValueError(f"--loads: zipf skew must be >= 0, got {s}")
        return [[_zipf(i + 1, s) for i in range(experts)]] * layers
    try:
        data = json.loads(Path(spec).read_text())
    except OSError as e:
        raise ValueError(f"--loads: give zipf:S or a JSON file; cannot read {spec}: "
                         f"{e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--loads: {spec} is not valid JSON ({e.msg} at line {e.lineno})") from None
    per_layer = as_layers(data, experts, layers)
    if per_layer is None:
        raise ValueError(f"--loads: {spec} must hold {experts} {LOADS_RULE}, or one such "
                         f"list per layer ({layers:,} in all)")
    return per_layer


# What ``as_layers`` takes, as error messages say it. (A layer whose loads sum past the
# largest float is the solver's to refuse: ``allocation.measured_loads`` says what to do.)
LOADS_RULE = "finite non-negative numbers"


def as_layers(data, experts: int, layers: int) -> list[list[float]] | None:
    """Loads given as one list of ``experts`` numbers (every layer alike) or ``layers``
    such lists, as floats per layer; None unless every load is a finite number >= 0 (JSON's
    true is not one: ``LOADS_RULE``)."""
    if isinstance(data, list) and data and all(_number(x) for x in data):
        data = [data] * layers
    if not isinstance(data, list) or len(data) != layers or not all(
            isinstance(l, list) and len(l) == experts and all(_number(x) and x >= 0 for x in l)
            for l in data):
        return None
    return [[float(x) for x in l] for l in data]


def _number(x) -> bool:
    """A finite int or float (an int past the largest float is not one: it has no float)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _zipf(rank: int, skew: float) -> float:
    """1 / rank^skew; 0 where rank^skew is beyond the largest float (skews of a few
    hundred), which is that load to within the smallest one."""
    try:
        return 1.0 / rank ** skew
    except OverflowError:
        return 0.0
