"""Goodput under failures: samples per minute with a worker SIGKILLed every 30 s.

The same job (tiny CPU model, 8 worker processes, a checkpoint every 10 steps, a SIGKILL of
one random worker every 30 s) under two strategies, in one invocation:

- Lazarus: the survivors re-plan, rebuild their group, move experts and redo the
  interrupted step.
- checkpoint-restart, as torchrun does (LocalJob's ``restart_on_failure``): every surviving
  worker is stopped, as many fresh processes start (the dead one is not replaced, so both
  strategies lose the same capacity), and they reload the last checkpoint; the steps since
  it are trained again. Two rows: with an instant rendezvous (a generous, idealised
  torchrun: the baseline the ratio is given against), and with torchrun's default
  rendezvous, which waits its last-call timeout (30 s in torch 2.15's
  ``dynamic_rendezvous``) whenever fewer than the maximum number of nodes rejoin, as they
  do after a lost node.

On a small machine shared with other work, step times drift by several times within
minutes, so the strategies run in alternating order (Lazarus, restart, restart, Lazarus,
...) and each row of the table sums its runs: a steady drift then weighs on both alike.
Running both at once would not help: the restart baseline's process start-ups would take
their CPU from the Lazarus job.

Each run trains for ``--duration`` seconds from when its workers are up (the kills count from
then too) and then ends at its next step of new progress. Goodput = steps of final progress
(redone steps count once) x globalBatch per minute of training: the first start-up of the
workers, the same for both and slow on a loaded machine, is left out; the baseline's
restarts are in.

    python benchmarks/bench_goodput.py [--rounds 2] [--duration 75] [--kill-every 30]

Target (issue 5): Lazarus >= 2x the baseline.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import yaml
from lazarus_core.job_spec import parse_manifest
from lazarus_runtime.config import RuntimeConfig
from lazarus_runtime.local_backend import RunResult

from bench_recovery import SPEC, WORKERS, manifest, run_job

# Far more steps than fit in the duration: the duration ends the run.
MAX_STEPS = 100_000
# label: (restart_on_failure, restart_wait_s)
STRATEGIES = {"lazarus": (False, 0.0), "checkpoint-restart": (True, 0.0),
              "torchrun defaults": (True, 30.0)}


def samples_per_minute(runs: list[RunResult], global_batch: int) -> float:
    """With the duration's end rule a run completed steps 1..N, N being its final progress,
    so steps_completed counts each step once."""
    steps = sum(r.steps_completed for r in runs)
    return steps * global_batch / sum(r.training_seconds for r in runs) * 60


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs per strategy, in alternating order")
    parser.add_argument("--duration", type=float, default=75.0,
                        help="seconds of training per run")
    parser.add_argument("--kill-every", type=float, default=30.0, help="seconds")
    args = parser.parse_args()

    runs: dict[str, list[RunResult]] = {label: [] for label in STRATEGIES}
    order = list(STRATEGIES)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for label in order if i % 2 == 0 else order[::-1]:
                print(f"{label}, run {len(runs[label]) + 1}: {WORKERS} workers, "
                      f"{args.duration:g} s, a SIGKILL every {args.kill_every:g} s", flush=True)
                # A job name per run: each checkpoints into a directory of its own.
                path = manifest(Path(tmp), f"{label.replace(' ', '-')}-{len(runs[label]) + 1}",
                                **SPEC)
                runs[label].append(run_job(
                    path, WORKERS, MAX_STEPS, kill_every_s=args.kill_every,
                    duration_s=args.duration, restart_on_failure=STRATEGIES[label][0],
                    restart_wait_s=STRATEGIES[label][1], timeout_s=args.duration * 4))
        _, spec = parse_manifest(yaml.safe_load(path.read_text()))
    global_batch = RuntimeConfig.from_manifest(dict(spec.runtime)).data.global_batch

    base = samples_per_minute(runs["checkpoint-restart"], global_batch)
    print(f"\nGoodput, {WORKERS} workers, one SIGKILL every {args.kill_every:g} s, checkpoint "
          f"every 10 steps, globalBatch {global_batch}, {args.rounds} runs per strategy")
    header = (f"{'strategy':<18} | {'training s':>10} | {'kills':>5} | {'final steps':>15} | "
              f"{'steps redone':>12} | {'restores':>8} | {'median recovery s':>17} | "
              f"{'samples/min':>11} | {'vs restart':>10}")
    print(header)
    print("-" * len(header))
    for label, rs in runs.items():
        recoveries = [x["seconds"] for r in rs for x in r.reconfigurations]
        rate = samples_per_minute(rs, global_batch)
        print(f"{label:<18} | {sum(r.training_seconds for r in rs):10.1f} | "
              f"{sum(r.failures for r in rs):5d} | "
              f"{' + '.join(str(r.steps_completed) for r in rs):>15} | "
              f"{sum(r.steps_redone for r in rs):12d} | "
              f"{sum(r.checkpoint_restores for r in rs):8d} | "
              f"{statistics.median(recoveries) if recoveries else float('nan'):17.2f} | "
              f"{rate:11.1f} | {rate / base:9.2f}x")
    print("median recovery: SIGKILL to the first step committed afterwards (for the "
          "baseline, a redone step).")
    ours = samples_per_minute(runs["lazarus"], global_batch)
    torchrun = samples_per_minute(runs["torchrun defaults"], global_batch)
    print(f"target: Lazarus >= 2x the checkpoint-restart baseline: "
          f"{'met' if ours >= 2 * base else 'MISSED'} against the instant-rendezvous restart "
          f"({ours / base:.2f}x), {'met' if ours >= 2 * torchrun else 'MISSED'} against "
          f"torchrun's default rendezvous ({ours / max(torchrun, 1e-9):.2f}x)")


if __name__ == "__main__":
    main()
