"""The paper's placement setting through `lazarus plan`: recovery by policy, skew and k.

    hack/bench.sh benchmarks/paper_placement_table.py   (its tables are in docs/placement.md)

N=10 nodes, c=6 slots, f=2, E=8 and E=16, zipf skew 0-1.5, one layer (the paper's
recovery figure is per model at one load snapshot; layers with equal loads fail together).
"""
import json
import subprocess
import sys
import tempfile

from lazarus_core.plan import POLICIES


def plan(experts: int, loads: str, policy: str, layers: int = 1) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "lazarus_cli.main", "plan", "--nodes", "10", "--slots", "6",
         "--experts", str(experts), "--layers", str(layers), "--min-replicas", "2",
         "--loads", loads, "--failures", "5", "--policy", policy, "--json"],
        check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def rotated_zipf_file(experts: int, layers: int, skew: float) -> str:
    """Per-layer loads whose hot expert differs from layer to layer, as in a trained model."""
    loads = [[1 / (((e + l) % experts) + 1) ** skew for e in range(experts)]
             for l in range(layers)]
    f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(loads, f)
    f.close()
    return f.name


def main():
    print("| E | zipf | replicas per expert | k | " + " | ".join(POLICIES) + " |")
    print("|---|---|---|---|" + "---|" * len(POLICIES))
    for experts in (8, 16):
        for skew in (0.0, 0.5, 1.0, 1.5):
            plans = {p: plan(experts, f"zipf:{skew}", p) for p in POLICIES}
            replicas = " ".join(map(str, plans["spread"]["replicas"][0]))
            if plans["mro"]["replicas"] != plans["spread"]["replicas"]:
                # MRO traded some replicas for balance (allocation.even_out).
                replicas += " (mro: " + " ".join(map(str, plans["mro"]["replicas"][0])) + ")"
            for k in range(1, 6):
                cells = " | ".join(f"{plans[p]['recovery'][str(k)]:.3f}" for p in POLICIES)
                first = f"{experts} | {skew} | {replicas}" if k == 1 else " | | "
                print(f"| {first} | {k} | {cells} |")
    print()
    print("Whole model, GPT-L shape: 12 layers, E=16, zipf 1.0 with each layer's hot expert "
          "rotated by its layer index.")
    print()
    print("| k | " + " | ".join(POLICIES) + " |")
    print("|---|" + "---|" * len(POLICIES))
    loads = rotated_zipf_file(16, 12, 1.0)
    plans = {p: plan(16, loads, p, layers=12) for p in POLICIES}
    for k in range(1, 6):
        print(f"| {k} | " + " | ".join(f"{plans[p]['recovery'][str(k)]:.3f}" for p in POLICIES)
              + " |")


if __name__ == "__main__":
    main()
