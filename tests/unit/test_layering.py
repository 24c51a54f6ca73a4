"""The floors of the house, as design.md draws them: the core (plan, solver, controller)
imports neither torch nor kopf nor any floor above it; the operator image has no torch; the
runtime needs no kopf. Checked twice: statically over every module's imports, and by really
importing each floor in a fresh interpreter where the forbidden packages cannot be found."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "lazarus_core": ROOT / "operator" / "lazarus_core",
    "lazarus_sim": ROOT / "operator" / "lazarus_sim",
    "lazarus_cli": ROOT / "operator" / "lazarus_cli",
    "lazarus_operator": ROOT / "operator" / "lazarus_operator",
    "lazarus_runtime": ROOT / "runtime" / "lazarus_runtime",
}
HEAVY = {"torch", "triton", "kopf", "kubernetes", "prometheus_client"}
# What each floor must never import, even lazily inside a function.
FORBIDDEN = {
    "lazarus_core": HEAVY | {"lazarus_sim", "lazarus_cli", "lazarus_operator", "lazarus_runtime"},
    "lazarus_sim": HEAVY | {"lazarus_cli", "lazarus_operator", "lazarus_runtime"},
    "lazarus_operator": {"torch", "triton", "lazarus_runtime", "lazarus_sim", "lazarus_cli"},
    "lazarus_runtime": {"kopf", "lazarus_operator", "lazarus_sim", "lazarus_cli"},
}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def modules(package: str) -> list[str]:
    base = PACKAGES[package]
    return sorted(".".join((package, *p.relative_to(base).with_suffix("").parts))
                  .removesuffix(".__init__") for p in base.rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_module_imports_a_floor_it_must_not(package):
    bad = {str(p.relative_to(ROOT)): sorted(imported_roots(p) & FORBIDDEN[package])
           for p in PACKAGES[package].rglob("*.py")}
    assert {p: roots for p, roots in bad.items() if roots} == {}


@pytest.mark.parametrize("package", ["lazarus_core", "lazarus_sim"])
def test_the_pure_floors_import_with_torch_and_kopf_unimportable(package):
    blocked = sorted(FORBIDDEN[package] - {package})
    probe = f"""
import importlib, importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"blocked for this test: {{name}}")
sys.meta_path.insert(0, Block())
for m in {modules(package)!r}:
    importlib.import_module(m)
print("imported", len({modules(package)!r}))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("imported")
