"""What Kubernetes accepts as a name, a label or a resource name (apimachinery's validation).

Each check returns None for a valid string, else why it is not valid, so the caller can
name the manifest field the string came from.
"""
from __future__ import annotations

import re

# A job's Services and pods are named after it ("<job>-coordinator", "<job>-worker-12"), and
# a Service name must be a DNS-1035 label: a leading letter, then letters, digits and '-'.
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_1123_SUBDOMAIN = re.compile(rf"^{_DNS_1123_LABEL}(\.{_DNS_1123_LABEL})*$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
# Pod resources that need no domain; anything else is an extended resource (vendor/name).
_STANDARD_RESOURCES = re.compile(r"^(cpu|memory|ephemeral-storage|hugepages-[0-9]+[KMG]i?)$")


def dns_1035_label(name: str, max_length: int = 63) -> str | None:
    if len(name) > max_length:
        return f"is {len(name)} characters long; the most is {max_length}"
    if not _DNS_1035.match(name):
        return ("must start with a lower-case letter and hold only lower-case letters, "
                "digits and '-', ending with a letter or digit (e.g. 'moe-run-1')")
    return None


def dns_1123_subdomain(name: str) -> str | None:
    if len(name) > 253:
        return f"is {len(name)} characters long; the most is 253"
    if not _DNS_1123_SUBDOMAIN.match(name):
        return ("must be lower-case letters, digits, '-' and '.', starting and ending with a "
                "letter or digit (e.g. 'lazarus-worker')")
    return None


def qualified_name(name: str) -> str | None:
    """A label key or a resource name: an optional DNS-subdomain prefix and '/', then a name
    of at most 63 characters."""
    prefix, slash, rest = name.rpartition("/")
    if slash and (not prefix or dns_1123_subdomain(prefix)):
        return f"has an invalid prefix {prefix!r}; it must be a DNS subdomain such as 'example.com'"
    if not rest or len(rest) > 63 or not _QUALIFIED_NAME.match(rest):
        return ("must be at most 63 letters, digits, '-', '_' or '.', starting and ending "
                "with a letter or digit, after an optional 'example.com/' prefix")
    return None


def label_value(value: str) -> str | None:
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        return ("must be empty or at most 63 letters, digits, '-', '_' or '.', starting and "
                "ending with a letter or digit")
    return None


def resource_name(name: str) -> str | None:
    """cpu, memory, ephemeral-storage, hugepages-<size>, or an extended resource vendor/name."""
    if _STANDARD_RESOURCES.match(name):
        return None
    if "/" not in name:
        return ("is not a standard resource (cpu, memory, ephemeral-storage, hugepages-<size>); "
                "an extended resource needs its vendor domain, e.g. nvidia.com/gpu")
    return qualified_name(name)


def is_extended_resource(name: str) -> bool:
    """Extended resources (GPUs and other devices) are counted in whole units only."""
    return "/" in name and not name.startswith("kubernetes.io/")
