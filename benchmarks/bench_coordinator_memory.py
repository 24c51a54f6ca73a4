"""The coordinator's memory over a long run: the tiny job for 10,000 steps, locally.

The local backend's parent process is the coordinator (the same StepCoordinator and job
channel as the coordinator pod on a cluster) and it hosts the job's store, so its resident
memory covers both: the coordinator's records and every key the channel leaves in the
store. Sampled every 500 steps, for the job as it runs (keys pruned behind it) and, side by
side, the same job with pruning turned off (what it was before keys were pruned), for
``--baseline-steps`` (fewer by default: its growth is linear, and 10,000 steps of it would
double the run's time on a shared machine).

    python benchmarks/bench_coordinator_memory.py [--steps 10000] [--baseline-steps 2000]
                                                  [--every 500]

The parent also keeps the local backend's own ledger (loss, lost and duplicated samples of
every step: 24 bytes a step, to check that no sample is lost), which a coordinator pod does
not; it is part of the growth measured here.

The job is examples/tiny-cpu.yaml (rebalancing every 20 steps); its loads seldom shift
enough for a rebalance, so a run may stay in generation 1 (the table's "gen" says), and only
step keys are pruned then. Generation keys are pruned by the same code
(tests/runtime/test_channel_trust.py keeps a store at its size across generations).
"""
from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import yaml
from lazarus_core.job_spec import parse_manifest
from lazarus_runtime import coordination
from lazarus_runtime.local_backend import LocalJob

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiny-cpu.yaml"
WORKERS = 2


def rss_bytes() -> int:
    """This process's resident memory (Linux: /proc/self/status)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def run(steps: int, every: int, tmp: Path, prune: bool) -> list[dict]:
    doc = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    doc["spec"]["checkpoint"] = {"path": str(tmp / "ckpt"), "everySteps": 1000}
    name, spec = parse_manifest(doc)
    saved = coordination.KEEP_STEPS, coordination.KEEP_GENERATIONS
    if not prune:
        coordination.KEEP_STEPS = coordination.KEEP_GENERATIONS = 10**12
    samples: list[dict] = []

    def sample(status: dict) -> None:
        # The last step ends the job without a progress report: its predecessor stands in.
        due = status["step"] % every == 0 or status["step"] == steps - 1
        if due and (not samples or samples[-1]["step"] < status["step"]):
            samples.append({"step": status["step"], "rss": rss_bytes(),
                            "keys": job.store.num_keys(), "blocks": sys.getallocatedblocks(),
                            "generation": status["generation"]})
            print(f"  {'pruned' if prune else 'unpruned'}: step {status['step']}, "
                  f"{samples[-1]['rss'] / 2**20:.1f} MiB, {samples[-1]['keys']} keys",
                  flush=True)

    job = LocalJob(name, spec, WORKERS, steps, checkpoint_dir=tmp / "ckpt" / name,
                   on_progress=sample, timeout_s=steps * 2.0)
    started = time.monotonic()
    try:
        result = job.run()
    finally:
        coordination.KEEP_STEPS, coordination.KEEP_GENERATIONS = saved
    assert result.steps_completed == steps and result.samples_lost == 0
    print(f"  {'pruned' if prune else 'unpruned'}: {steps} steps in "
          f"{time.monotonic() - started:.0f} s", flush=True)
    return samples


def growth_per_1000_steps(samples: list[dict], key: str) -> float:
    """Growth over the second half of the run, per 1,000 steps (the first half warms up)."""
    half = samples[len(samples) // 2]
    last = samples[-1]
    return (last[key] - half[key]) / (last["step"] - half["step"]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--baseline-steps", type=int, default=2_000)
    parser.add_argument("--every", type=int, default=500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ours = run(args.steps, args.every, Path(tmp) / "pruned", prune=True)
        baseline = run(args.baseline_steps, args.every, Path(tmp) / "unpruned", prune=False)

    print(f"\nCoordinator (local parent process) over {args.steps} steps of the tiny job, "
          f"{WORKERS} workers: resident memory and keys in the store; the same job with "
          f"pruning off for {args.baseline_steps} steps beside it")
    header = (f"{'step':>6} | {'gen':>4} | {'RSS MiB, pruned':>15} | {'keys':>6} | "
              f"{'RSS MiB, unpruned':>17} | {'keys':>7}")
    print(header)
    print("-" * len(header))
    theirs = {b["step"]: b for b in baseline}
    for a in ours:
        b = theirs.get(a["step"])
        other = (f"{b['rss'] / 2**20:17.1f} | {b['keys']:>7}" if b else f"{'':>17} | {'':>7}")
        print(f"{a['step']:>6} | {a['generation']:>4} | {a['rss'] / 2**20:15.1f} | "
              f"{a['keys']:>6} | {other}")
    print("\ngrowth per 1,000 steps over the second half of each run (pruned / unpruned):")
    for label, key, unit in (("resident memory", "rss", 2**10), ("store keys", "keys", 1),
                             ("Python heap blocks", "blocks", 1)):
        mine, other = growth_per_1000_steps(ours, key), growth_per_1000_steps(baseline, key)
        suffix = " KiB" if unit > 1 else ""
        ratio = f"{mine / other:.3f}" if other else "n/a"
        print(f"  {label:<19} pruned {mine / unit:10.1f}{suffix}   unpruned "
              f"{other / unit:10.1f}{suffix}   ratio {ratio}")


if __name__ == "__main__":
    main()
