"""Goodput under failures: samples per minute with a worker SIGKILLed every 30 s.

The same job (tiny CPU model, 8 workers, a checkpoint every 10 steps, one random node
SIGKILLed every 30 s) under each strategy, in one invocation:

- Lazarus: the survivors re-plan, rebuild their group, move experts and redo the
  interrupted step.
- torchrun itself (``torchrun_baseline``): one elastic agent per node running the same
  model, engine and checkpoints with a fixed group; a lost node makes every agent restart
  its worker from the last checkpoint after a new rendezvous round. Two rows: torchrun's
  default rendezvous settings, which wait out a dead node's keep-alives (15 s) and then a
  last call for more nodes (30 s) whenever fewer than the maximum rejoin, as after every
  loss; and settings tuned for fast restarts (a 1 s last call, dead nodes dropped after
  2 s).
- an idealised restart (``RestartingLocalJob``): fresh processes restore the
  last checkpoint the moment the death is seen, with no rendezvous at all. No real launcher
  restarts faster; it bounds what any checkpoint-restart design could reach here.

In every strategy the dead node is not replaced, so all lose the same capacity.

On a small machine shared with other work, step times drift by several times within
minutes, so the strategies run in rotating order and each row sums its runs: a steady
drift then weighs on all alike. Running them at once would not help: one's process
start-ups would take their CPU from the others.

Each run trains for ``--duration`` seconds from when its workers are up (the kills count from
then too) and then ends at its next step of new progress. Goodput = steps of final progress
(redone steps count once) x globalBatch per minute of training: the first start-up of the
workers, the same for all and slow on a loaded machine, is left out; restarts are in.

    python benchmarks/bench_goodput.py [--rounds 2] [--duration 75] [--kill-every 30]

Target (issue 5): Lazarus >= 2x checkpoint-restart as torchrun does it.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml
from lazarus_core.runtime_config import RuntimeConfig
from lazarus_runtime.local_backend import LocalJob, RunResult
from lazarus_runtime.restart_baseline import RestartingLocalJob

from bench_recovery import EXAMPLE, SPEC, WORKERS, manifest, run_job
from torchrun_baseline import FAST_RDZV, TorchrunRun, run_torchrun

# Far more steps than fit in the duration: the duration ends the run.
MAX_STEPS = 100_000
LAZARUS, IDEAL = "lazarus", "idealised restart"
# torchrun rows: their rendezvous settings (--rdzv-conf); {} is torchrun's defaults.
TORCHRUN = {"torchrun, defaults": {}, "torchrun, tuned": FAST_RDZV}
STRATEGIES = [LAZARUS, *TORCHRUN, IDEAL]


@dataclass
class Run:
    steps: int  # final progress: with the duration's end rule, steps 1..N each count once
    seconds: float
    kills: int
    redone: int
    restores: int
    recoveries: list[float]  # SIGKILL to the next completed step (a redone one, on restart)

    @classmethod
    def of_local(cls, r: RunResult) -> "Run":
        return cls(r.steps_completed, r.training_seconds, r.failures, r.steps_redone,
                   r.checkpoint_restores, [x["seconds"] for x in r.reconfigurations])

    @classmethod
    def of_torchrun(cls, r: TorchrunRun) -> "Run":
        return cls(r.steps_completed, r.training_seconds, r.failures, r.steps_redone,
                   r.restarts, r.recoveries)


def samples_per_minute(runs: list[Run], global_batch: int) -> float:
    return sum(r.steps for r in runs) * global_batch / sum(r.seconds for r in runs) * 60


def run_strategy(label: str, tmp: Path, name: str, args) -> Run:
    # A job name per run: each checkpoints into a directory of its own.
    path = manifest(tmp, name, **SPEC)
    if label in TORCHRUN:
        return Run.of_torchrun(run_torchrun(
            path, name, WORKERS, args.kill_every, args.duration, TORCHRUN[label], tmp,
            on_event=lambda line: print(f"  {name}: {line}", flush=True)))
    return Run.of_local(run_job(
        path, WORKERS, MAX_STEPS, kill_every_s=args.kill_every, duration_s=args.duration,
        job_class=RestartingLocalJob if label == IDEAL else LocalJob,
        timeout_s=args.duration * 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs per strategy, in alternating order")
    parser.add_argument("--duration", type=float, default=75.0,
                        help="seconds of training per run")
    parser.add_argument("--kill-every", type=float, default=30.0, help="seconds")
    args = parser.parse_args()

    runs: dict[str, list[Run]] = {label: [] for label in STRATEGIES}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for label in STRATEGIES if i % 2 == 0 else STRATEGIES[::-1]:
                n = len(runs[label]) + 1
                print(f"{label}, run {n}: {WORKERS} workers, {args.duration:g} s, a SIGKILL "
                      f"every {args.kill_every:g} s", flush=True)
                name = f"{label.replace(' ', '-').replace(',', '')}-{n}"
                runs[label].append(run_strategy(label, Path(tmp), name, args))
    runtime = yaml.safe_load(EXAMPLE.read_text())["spec"]["runtime"]
    global_batch = RuntimeConfig.from_manifest(runtime).data.global_batch

    rates = {label: samples_per_minute(rs, global_batch) for label, rs in runs.items()}
    print(f"\nGoodput, {WORKERS} workers, one SIGKILL every {args.kill_every:g} s, checkpoint "
          f"every 10 steps, globalBatch {global_batch}, {args.rounds} runs per strategy")
    header = (f"{'strategy':<18} | {'training s':>10} | {'kills':>5} | {'final steps':>15} | "
              f"{'steps redone':>12} | {'restores':>8} | {'median recovery s':>17} | "
              f"{'samples/min':>11} | {'Lazarus / it':>12}")
    print(header)
    print("-" * len(header))
    for label, rs in runs.items():
        recoveries = [x for r in rs for x in r.recoveries]
        print(f"{label:<18} | {sum(r.seconds for r in rs):10.1f} | "
              f"{sum(r.kills for r in rs):5d} | "
              f"{' + '.join(str(r.steps) for r in rs):>15} | "
              f"{sum(r.redone for r in rs):12d} | {sum(r.restores for r in rs):8d} | "
              f"{statistics.median(recoveries) if recoveries else float('nan'):17.2f} | "
              f"{rates[label]:11.1f} | {rates[LAZARUS] / max(rates[label], 1e-9):11.2f}x")
    print("median recovery: SIGKILL to the first step completed afterwards (for a restart, "
          "a redone step), over the kills followed by one before the run ended.")
    for label in [*TORCHRUN, IDEAL]:
        ratio = rates[LAZARUS] / max(rates[label], 1e-9)
        print(f"target Lazarus >= 2x {label}: {'met' if ratio >= 2 else 'MISSED'} "
              f"({ratio:.2f}x)")


if __name__ == "__main__":
    main()
