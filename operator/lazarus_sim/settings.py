"""Typed settings from a config mapping: unknown keys and wrong types name their field."""
from __future__ import annotations

import math
from dataclasses import fields, replace


def mapping(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: must be a mapping, got {value!r}")
    return value


def checked(given, defaults: dict, where: str) -> dict:
    """``defaults`` updated from ``given``; each value must have its default's type."""
    values = dict(defaults)
    for key, value in mapping(given, where).items():
        if key not in defaults:
            raise ValueError(f"{where}.{key}: unknown field; known: {', '.join(defaults)}")
        want = type(defaults[key])
        if want is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if ok and not math.isfinite(value):
                # NaN passes every range check the callers make (a comparison with NaN is
                # false), and ran to an assertion; an infinite duration never ends.
                raise ValueError(f"{where}.{key}: must be a finite number, got {value!r}")
        else:
            ok = isinstance(value, want) and (want is bool or not isinstance(value, bool))
        if not ok:
            raise ValueError(f"{where}.{key}: must be a {want.__name__}, got {value!r}")
        values[key] = float(value) if want is float else value
    return values


def override(obj, given, where: str, may_be_zero: tuple[str, ...] = ()):
    """The dataclass ``obj`` with fields replaced from ``given``; numbers must be > 0."""
    defaults = {f.name: getattr(obj, f.name) for f in fields(obj)}
    values = checked(given, defaults, where)
    for key, value in values.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if value < 0 or (value == 0 and key not in may_be_zero):
                raise ValueError(f"{where}.{key}: must be > 0, got {value}")
    return replace(obj, **values)
