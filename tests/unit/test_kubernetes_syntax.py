"""Kubernetes quantities, names and labels, as the API server accepts them."""
from decimal import Decimal

import pytest

from lazarus_core import kube_names
from lazarus_core.quantity import parse_quantity


@pytest.mark.parametrize("text, value", [
    ("500m", Decimal("0.5")), ("2", Decimal(2)), (8, Decimal(8)), ("1.5", Decimal("1.5")),
    ("8Gi", Decimal(8 * 2**30)), ("1Ki", Decimal(1024)), ("1k", Decimal(1000)),
    ("1e3", Decimal(1000)), ("1E3", Decimal(1000)), ("1E", Decimal(10**18)),
    (".5", Decimal("0.5")), ("5.", Decimal(5)), ("+1M", Decimal(10**6)), ("0", Decimal(0)),
    ("2e-3", Decimal("0.002")),
])
def test_quantities_parse_to_their_value(text, value):
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", [
    "lots", "", "-1", "-1Gi", "1 Gi", "1gi", "1Gib", "1e", "1e1.5", "0x10", "1e9999",
    "nan", "inf", 1.5, True, None, {"cpu": 1}, "1..2", ".",
])
def test_what_is_not_a_quantity_is_refused_with_examples(text):
    with pytest.raises(ValueError, match="500m"):
        parse_quantity(text)


@pytest.mark.parametrize("name, ok", [
    ("job", True), ("moe-run-1", True), ("a", True), ("1job", False), ("my.job", False),
    ("Job", False), ("job-", False), ("jöb", False), ("", False), ("j" * 40, True),
])
def test_job_names_are_dns_1035_labels(name, ok):
    assert (kube_names.dns_1035_label(name, 40) is None) == ok
    assert kube_names.dns_1035_label("j" * 41, 40).startswith("is 41 characters")


@pytest.mark.parametrize("name, ok", [
    ("cpu", True), ("memory", True), ("ephemeral-storage", True), ("hugepages-2Mi", True),
    ("nvidia.com/gpu", True), ("gpu", False), ("nvidia.com/", False), ("/gpu", False),
    ("Nvidia_com/gpu", False),
])
def test_resource_names(name, ok):
    assert (kube_names.resource_name(name) is None) == ok


def test_label_keys_and_values():
    assert kube_names.qualified_name("team") is None
    assert kube_names.qualified_name("example.com/team") is None
    assert kube_names.qualified_name("a b") is not None
    assert kube_names.label_value("") is None and kube_names.label_value("moe-1") is None
    assert kube_names.label_value("a b") is not None
    assert kube_names.label_value("x" * 64) is not None
