"""Print two `lazarus run --summary-json` loss curves side by side, and how far apart they are."""
import json
import sys


def main(faulty_path: str, reference_path: str) -> int:
    faulty = json.load(open(faulty_path))
    reference = json.load(open(reference_path))
    changed = {}
    for r in faulty["reconfigurations"]:
        changed.setdefault(r["generation"], r["reason"])
    print(f"{'step':>4}  {'with failures':>13}  {'without':>9}  {'difference':>10}")
    worst = 0.0
    for step, (a, b) in enumerate(zip(faulty["losses"], reference["losses"]), start=1):
        worst = max(worst, abs(a - b))
        print(f"{step:>4}  {a:>13.5f}  {b:>9.5f}  {a - b:>10.1e}")
    print(f"\n{faulty['failures']} workers killed, {len(faulty['reconfigurations'])} "
          f"reconfigurations, {faulty['samples_lost']} samples lost, "
          f"{faulty['samples_duplicated']} duplicated; largest loss difference {worst:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
