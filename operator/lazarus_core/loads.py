"""Expert loads as users give them (``--loads``, a simulator config): the input of replica
allocation (``allocation.py``)."""
from __future__ import annotations

import json
from pathlib import Path


def parse_loads(spec: str, experts: int, layers: int) -> list[list[float]]:
    if spec.startswith("zipf:"):
        try:
            s = float(spec[5:])
        except ValueError:
            raise ValueError(f"--loads: zipf skew must be a number, got {spec[5:]!r}") from None
        if s < 0:
            raise ValueError(f"--loads: zipf skew must be >= 0, got {s}")
        return [[_zipf(i + 1, s) for i in range(experts)]] * layers
    try:
        data = json.loads(Path(spec).read_text())
    except OSError as e:
        raise ValueError(f"--loads: cannot read {spec}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--loads: {spec} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(data, list) and all(isinstance(x, (int, float)) for x in data):
        data = [data] * layers
    if (not isinstance(data, list) or len(data) != layers
            or not all(isinstance(l, list) and len(l) == experts
                       and all(isinstance(x, (int, float)) and x >= 0 for x in l) for l in data)):
        raise ValueError(f"--loads: {spec} must hold {experts} non-negative numbers, "
                         f"or {layers} such lists (one per layer)")
    return data


def _zipf(rank: int, skew: float) -> float:
    """1 / rank^skew; 0 where rank^skew is beyond the largest float (skews of a few
    hundred), which is that load to within the smallest one."""
    try:
        return 1.0 / rank ** skew
    except OverflowError:
        return 0.0
