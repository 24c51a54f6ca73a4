"""Reading a manifest while collecting every violation, so a user sees all its problems at
once; each violation names the manifest field, says what is wrong and how to fix it, and
carries a CamelCase reason for a status condition."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Violation:
    field: str  # manifest path, e.g. "spec.maxNodes"
    reason: str  # CamelCase, for a status condition
    message: str  # names the field and the fix

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class SpecError(ValueError):
    """A spec that can never run; ``violations`` lists every problem, each naming its field."""

    def __init__(self, violations: list[Violation]):
        self.violations = violations
        super().__init__("; ".join(str(v) for v in violations))

    @property
    def reason(self) -> str:
        return self.violations[0].reason


class SpecReader:
    """Collects violations while the parser reads a manifest."""

    def __init__(self):
        self.violations: list[Violation] = []

    def bad(self, path: str, reason: str, message: str) -> None:
        self.violations.append(Violation(path, reason, message))

    def has(self, path: str) -> bool:
        """Whether ``path`` already has a violation (another check need not repeat it)."""
        return any(v.field == path for v in self.violations)

    def integer(self, d: Mapping, where: str, key: str, default: int | None, *,
                minimum: int, maximum: int | None = None) -> int | None:
        v = d.get(key, default)
        path = f"{where}.{key}"
        if v is None:
            self.bad(path, "MissingField", "is required")
            return None
        if not isinstance(v, int) or isinstance(v, bool):
            self.bad(path, "InvalidField", f"must be an integer, got {v!r}")
            return None
        if v < minimum or (maximum is not None and v > maximum):
            bounds = f">= {minimum}" if maximum is None else f"between {minimum} and {maximum}"
            self.bad(path, "InvalidField", f"must be {bounds}, got {v}")
            return None
        return v

    def mapping(self, d: Mapping, where: str, key: str, reason: str) -> Mapping:
        """``d[key]`` if it is an object (absent: empty), else a violation and {}."""
        v = d.get(key)
        if v is None:
            return {}
        if not isinstance(v, Mapping):
            self.bad(f"{where}.{key}", reason, f"must be an object, got {v!r}")
            return {}
        return v

    def raise_if_any(self) -> None:
        if self.violations:
            raise SpecError(self.violations)
