"""Kubernetes resource quantities ("500m", "8Gi", "1e3"), parsed as the API server parses them.

The grammar is apimachinery's (k8s.io/apimachinery/pkg/api/resource/quantity.go):

    quantity ::= signedNumber suffix
    suffix   ::= binarySI (Ki Mi Gi Ti Pi Ei) | decimalSI (m "" k M G T P E)
               | decimalExponent ("e" or "E", then a signed integer)
    number   ::= digits | digits "." digits | digits "." | "." digits

The CRD's pattern for ``resources`` (crds/lazarusjob.yaml) is ``PATTERN``, so a value the
schema accepts is one this module accepts; tests/unit/test_job_spec.py checks that they are
the same text.
"""
from __future__ import annotations

import re
from decimal import Decimal

# Non-negative only: a pod's requests and limits must be >= 0, so a sign of "-" is refused
# here and at admission rather than when the operator creates the pod.
PATTERN = (r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
           r"(([KMGTPE]i)|[mkMGTPE]|([eE][+-]?[0-9]{1,3}))?$")
_QUANTITY = re.compile(PATTERN)
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def parse_quantity(value: object) -> Decimal:
    """The value of a quantity as a manifest holds it (a string, or a YAML integer).

    Raises ValueError with the accepted forms. Exponents are limited to three digits: larger
    ones describe no real resource, and would make the arithmetic slow."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"{value!r} is not a quantity; write a string such as \"500m\", "
                         f"\"2\" or \"8Gi\"")
    text = str(value)
    match = _QUANTITY.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a non-negative Kubernetes quantity such as "
                         f"\"500m\", \"2\", \"1.5\", \"8Gi\" or \"1e3\"")
    number, suffix = match.group(1), match.group(5) or ""
    amount = Decimal(number)
    if suffix in _BINARY:
        return amount * (1024 ** _BINARY[suffix])
    if suffix in _DECIMAL:
        return amount.scaleb(_DECIMAL[suffix])
    return amount.scaleb(int(suffix[1:]))
