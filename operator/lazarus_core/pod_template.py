"""Checks of what a LazarusJob puts into its pods (``spec.template``, ``spec.coordinator``).

Everything the pod builders copy into a Pod is checked here against the rules the API
server applies when the pod is created, so a spec that could never make a pod is refused
when it is applied (or run locally), not by every pod creation of a running job.
"""
from __future__ import annotations

from collections.abc import Mapping

from . import kube_names
from .quantity import parse_quantity
from .spec_reader import SpecReader

GPU_RESOURCE = "nvidia.com/gpu"
TEMPLATE_KEYS = ("image", "imagePullPolicy", "labels", "command", "env", "resources",
                 "nodeSelector", "tolerations", "serviceAccountName", "priorityClassName",
                 "volumes", "volumeMounts")
COORDINATOR_KEYS = ("nodeSelector", "tolerations", "resources")
_PULL_POLICIES = ("Always", "IfNotPresent", "Never")
_TOLERATION_OPERATORS = ("Exists", "Equal")
_TAINT_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")


def check_template(p: SpecReader, template: Mapping, gpus: int | None) -> None:
    """``spec.template``; ``gpus`` (gpusPerNode, None if invalid) must match a GPU request."""
    where = "spec.template"
    _known_keys(p, template, where, TEMPLATE_KEYS)
    image = template.get("image")
    if image is not None and (not isinstance(image, str) or not image.strip()):
        p.bad(f"{where}.image", "InvalidTemplate", f"must be an image reference, got {image!r}")
    policy = template.get("imagePullPolicy")
    if policy is not None and policy not in _PULL_POLICIES:
        p.bad(f"{where}.imagePullPolicy", "InvalidTemplate",
              f"must be one of {', '.join(_PULL_POLICIES)}, got {policy!r}")
    _labels(p, template.get("labels"), f"{where}.labels")
    command = template.get("command")
    if command is not None and (not isinstance(command, list) or not command
                                or not all(isinstance(a, str) for a in command)):
        p.bad(f"{where}.command", "InvalidTemplate",
              "must be a non-empty list of strings, e.g. [python, -m, lazarus_runtime.worker]")
    _env(p, template.get("env"), f"{where}.env")
    _resources(p, template.get("resources"), f"{where}.resources", gpus)
    _labels(p, template.get("nodeSelector"), f"{where}.nodeSelector")
    _tolerations(p, template.get("tolerations"), f"{where}.tolerations")
    for key in ("serviceAccountName", "priorityClassName"):
        name = template.get(key)
        why = (kube_names.dns_1123_subdomain(name) if isinstance(name, str)
               else f"must be a string, got {name!r}") if name is not None else None
        if why:
            p.bad(f"{where}.{key}", "InvalidTemplate", why)
    for key in ("volumes", "volumeMounts"):
        items = template.get(key)
        if items is not None and (not isinstance(items, list)
                                  or not all(isinstance(i, Mapping) for i in items)):
            p.bad(f"{where}.{key}", "InvalidTemplate", "must be a list of objects, as in a Pod")


def check_coordinator(p: SpecReader, coordinator: Mapping) -> None:
    where = "spec.coordinator"
    _known_keys(p, coordinator, where, COORDINATOR_KEYS)
    _labels(p, coordinator.get("nodeSelector"), f"{where}.nodeSelector")
    _tolerations(p, coordinator.get("tolerations"), f"{where}.tolerations")
    _resources(p, coordinator.get("resources"), f"{where}.resources", None)


def _known_keys(p: SpecReader, d: Mapping, where: str, known: tuple[str, ...]) -> None:
    for key in sorted(set(d) - set(known)):
        p.bad(f"{where}.{key}", "UnknownField",
              f"is not a field Lazarus reads; known fields are {', '.join(known)}")


def _labels(p: SpecReader, labels: object, where: str) -> None:
    """Label maps (labels, nodeSelector): qualified-name keys, label-value values."""
    if labels is None:
        return
    if not isinstance(labels, Mapping):
        p.bad(where, "InvalidTemplate", "must be an object of label keys to values")
        return
    for key, value in labels.items():
        why = (kube_names.qualified_name(key) if isinstance(key, str) else "must be a string")
        if why:
            p.bad(f"{where}[{key}]", "InvalidLabel", f"key {key!r} {why}")
        elif not isinstance(value, str):
            p.bad(f"{where}[{key}]", "InvalidLabel",
                  f"must be a string, got {value!r}; quote it in YAML")
        elif why := kube_names.label_value(value):
            p.bad(f"{where}[{key}]", "InvalidLabel", f"value {value!r} {why}")


def _env(p: SpecReader, env: object, where: str) -> None:
    if env is None:
        return
    if not isinstance(env, list):
        p.bad(where, "InvalidTemplate", "must be a list of {name, value} objects")
        return
    names = set()
    for i, var in enumerate(env):
        name = var.get("name") if isinstance(var, Mapping) else None
        if not isinstance(name, str) or not name or "=" in name:
            p.bad(f"{where}[{i}]", "InvalidTemplate",
                  "must be an object with a name (no '='), as in a container's env")
        elif name in names:
            p.bad(f"{where}[{i}]", "InvalidTemplate", f"sets {name} twice; keep one")
        else:
            names.add(name)
            value = var.get("value")
            if value is not None and not isinstance(value, str):
                p.bad(f"{where}[{i}].value", "InvalidTemplate",
                      f"must be a string, got {value!r}; quote it in YAML")


def _tolerations(p: SpecReader, tolerations: object, where: str) -> None:
    if tolerations is None:
        return
    if not isinstance(tolerations, list):
        p.bad(where, "InvalidTemplate", "must be a list of tolerations, as in a Pod")
        return
    for i, t in enumerate(tolerations):
        if not isinstance(t, Mapping):
            p.bad(f"{where}[{i}]", "InvalidTemplate", "must be an object, as in a Pod")
            continue
        operator, effect = t.get("operator", "Equal"), t.get("effect", "")
        if operator not in _TOLERATION_OPERATORS:
            p.bad(f"{where}[{i}].operator", "InvalidTemplate",
                  f"must be Exists or Equal, got {operator!r}")
        if effect not in _TAINT_EFFECTS:
            p.bad(f"{where}[{i}].effect", "InvalidTemplate",
                  f"must be NoSchedule, PreferNoSchedule or NoExecute, got {effect!r}")


def _resources(p: SpecReader, resources: object, where: str, gpus: int | None) -> None:
    """Requests and limits as the API server checks a container's: known resource names,
    non-negative quantities, requests no greater than limits, and devices (extended
    resources such as nvidia.com/gpu) in whole units, with limits equal to requests."""
    if resources is None:
        return
    if not isinstance(resources, Mapping):
        p.bad(where, "InvalidResources",
              f"must be an object with limits and requests, e.g. {{requests: {{cpu: \"8\"}}}}, "
              f"got {resources!r}")
        return
    amounts = {}
    for kind in sorted(resources):
        if kind not in ("limits", "requests"):
            p.bad(f"{where}.{kind}", "InvalidResources", "only limits and requests are supported")
            continue
        given = resources[kind]
        if not isinstance(given, Mapping):
            p.bad(f"{where}.{kind}", "InvalidResources",
                  f"must map resource names to quantities, e.g. {{cpu: \"8\", memory: 32Gi}}, "
                  f"got {given!r}")
            continue
        amounts[kind] = {}
        for name, value in given.items():
            path = f"{where}.{kind}[{name}]"
            why = kube_names.resource_name(name) if isinstance(name, str) else "must be a string"
            if why:
                p.bad(path, "InvalidResources", f"resource name {why}")
                continue
            try:
                amount = parse_quantity(value)
            except ValueError as e:
                p.bad(path, "InvalidResources", str(e))
                continue
            if kube_names.is_extended_resource(name) and amount != amount.to_integral_value():
                p.bad(path, "InvalidResources", f"{name} is counted in whole devices, got {value}")
                continue
            amounts[kind][name] = amount
    limits, requests = amounts.get("limits", {}), amounts.get("requests", {})
    for name, request in requests.items():
        path = f"{where}.requests[{name}]"
        if name in limits and request > limits[name]:
            p.bad(path, "InvalidResources",
                  f"{resources['requests'][name]} exceeds the limit {resources['limits'][name]}; "
                  f"lower the request or raise the limit")
        elif kube_names.is_extended_resource(name) and limits.get(name) != request:
            p.bad(path, "InvalidResources",
                  f"a device cannot be overcommitted: set limits[{name}] equal to the request")
    if gpus is None:
        return
    for kind, given in amounts.items():
        if GPU_RESOURCE in given and given[GPU_RESOURCE] != gpus:
            p.bad(f"{where}.{kind}[{GPU_RESOURCE}]", "GpuRequestMismatch",
                  f"requests {resources[kind][GPU_RESOURCE]} GPUs but gpusPerNode is {gpus}; "
                  f"make them equal (each GPU hosts one worker rank), or leave it out for CPU "
                  f"workers")
