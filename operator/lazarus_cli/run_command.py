"""`lazarus run JOB.yaml --local`: a LazarusJob as worker processes on this machine."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import yaml

from lazarus_core.job_spec import SpecError, parse_manifest
from lazarus_core.plan import member_name


def register(sub) -> None:
    p = sub.add_parser("run", help="run a LazarusJob manifest (--local: on this machine)")
    p.add_argument("manifest", type=Path, help="the LazarusJob YAML, as for kubectl apply")
    p.add_argument("--local", action="store_true", required=True,
                   help="run the workers as local processes (the only backend of `run`)")
    p.add_argument("--workers", type=int, default=None,
                   help="worker processes to start (default: spec.replicas)")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps to complete (default: spec.steps, else 30)")
    p.add_argument("--kill", default="",
                   help="failures to inject: STEP:COUNT[,STEP:COUNT...] SIGKILLs COUNT random "
                        "workers (nodes) as STEP begins; STEP:worker-1+worker-2 names them, "
                        "STEP:worker-1/0 one rank (its GPU) of a node")
    p.add_argument("--join", default="",
                   help="growth: STEP:COUNT[,...] starts COUNT more workers before STEP")
    p.add_argument("--seed", type=int, default=0, help="chooses which workers --kill hits")
    p.add_argument("--summary-json", type=Path, default=None,
                   help="write the run's summary (losses, reconfigurations, ...) here")
    p.set_defaults(func=run)


def parse_kills(text: str):
    from lazarus_runtime.local_faults import Fault

    faults = []
    for item in filter(None, text.split(",")):
        step, _, what = item.partition(":")
        if not step.isdigit() or int(step) < 1 or not what:
            raise ValueError(f"--kill: {item!r} is not STEP:COUNT or STEP:NAME+NAME "
                             f"(STEP >= 1)")
        if what.isdigit():
            faults.append(Fault(int(step), count=int(what)))
        else:
            faults.append(Fault(int(step), names=tuple(what.split("+"))))
    return faults


def parse_joins(text: str) -> list[tuple[int, int]]:
    joins = []
    for item in filter(None, text.split(",")):
        step, _, count = item.partition(":")
        if not (step.isdigit() and count.isdigit() and int(step) >= 2 and int(count) >= 1):
            raise ValueError(f"--join: {item!r} is not STEP:COUNT (STEP >= 2, COUNT >= 1)")
        joins.append((int(step), int(count)))
    return joins


def most_alive(workers: int, kills, joins: list[tuple[int, int]]) -> tuple[int, int]:
    """The most workers alive at once and the step it is first reached at: joins start
    theirs before STEP, and kills of whole workers (not of one rank: ``worker-N/R``) stop
    theirs as STEP begins, counted first where both fall on one step."""
    changes = sorted([(f.step, 0, -(f.count or sum("/" not in n for n in f.names)))
                      for f in kills] + [(step, 1, count) for step, count in joins])
    alive, most, at = workers, workers, 1
    for step, _, change in changes:
        alive = max(alive + change, 0)
        if alive > most:
            most, at = alive, step
    return most, at


def run(args) -> int:
    try:
        doc = yaml.safe_load(args.manifest.read_text())
    except OSError as e:
        raise ValueError(f"{args.manifest}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{args.manifest}: not valid YAML ({str(e).splitlines()[0]})") from None
    try:
        name, spec = parse_manifest(doc)
    except SpecError as e:
        raise ValueError(f"{args.manifest}: {e}") from None
    workers = spec.target_nodes if args.workers is None else args.workers
    if workers < spec.fewest_nodes:
        raise ValueError(f"--workers: the job needs at least {spec.fewest_nodes} workers "
                         f"(spec.minNodes, and enough slots for every expert's minReplicas)")
    if workers > spec.max_nodes:
        raise ValueError(f"--workers: {workers} exceeds spec.maxNodes ({spec.max_nodes}); "
                         f"raise maxNodes in the manifest or start fewer workers")
    if args.steps is None:
        args.steps = spec.steps or 30
    if args.steps < 1:
        raise ValueError(f"--steps: must be >= 1, got {args.steps}")
    kills, joins = parse_kills(args.kill), parse_joins(args.join)
    for flag, steps in (("--kill", [f.step for f in kills]), ("--join", [s for s, _ in joins])):
        if any(step > args.steps for step in steps):
            raise ValueError(f"{flag}: every STEP must be <= --steps ({args.steps})")
    most, step = most_alive(workers, kills, joins)
    if most > spec.max_nodes:
        # Each worker is a process tree of its own: --join 5:100000 started them by the
        # hundred before anything refused.
        raise ValueError(f"--join: {most} workers would be alive at step {step}, past "
                         f"spec.maxNodes ({spec.max_nodes}); join fewer or raise maxNodes")
    nodes = [f"worker-{i}" for i in range(workers + sum(c for _, c in joins))]
    known = set(nodes) | {member_name(n, d) for n in nodes for d in range(spec.gpus_per_node)}
    unknown = sorted({n for f in kills for n in f.names} - known)
    if unknown:
        raise ValueError(f"--kill: no worker named {', '.join(unknown)}; workers are "
                         f"worker-0 .. worker-{len(nodes) - 1}, and their ranks worker-N/0 .. "
                         f"worker-N/{spec.gpus_per_node - 1}")

    from lazarus_runtime.local_backend import LocalJob

    checkpoint_dir = None
    if spec.checkpoint:
        # A fresh directory per run: a restore must never pick up another run's weights.
        # (A string, not a Path: the location may be a URL such as s3://bucket/prefix.)
        checkpoint_dir = (spec.checkpoint.path.rstrip("/") + "/"
                          + time.strftime(f"run-%Y%m%d-%H%M%S-{name}"))
    console = _Console()
    job = LocalJob(name, spec, workers, args.steps, kills, joins,
                   checkpoint_dir, args.seed, on_event=console.event,
                   on_progress=console.progress)
    console.event(f"job {name}: {workers} workers, {args.steps} steps, "
                  f"{spec.experts} experts x {spec.layers} layers, placement {spec.policy}"
                  + (f", checkpoints in {checkpoint_dir}" if checkpoint_dir else ""))
    try:
        result = job.run()
    except (RuntimeError, TimeoutError) as e:
        console.event(f"failed: {e}")
        return 1
    console.finish(result)
    if args.summary_json:
        args.summary_json.write_text(json.dumps(result.to_dict(), indent=1))
    return 0


class _Console:
    """A live progress line on a terminal, plain lines otherwise; events on their own line."""

    def __init__(self):
        self.tty = sys.stderr.isatty()
        self.start = time.monotonic()
        self.last_line = ""

    def event(self, text: str) -> None:
        if self.tty and self.last_line:
            sys.stderr.write("\r\033[K")
        sys.stderr.write(f"[{time.monotonic() - self.start:6.2f}s] {text}\n")
        if self.tty and self.last_line:
            sys.stderr.write(self.last_line)
        sys.stderr.flush()

    def progress(self, s: dict) -> None:
        elapsed = time.monotonic() - self.start
        line = (f"step {s['step']:>4}/{s['steps']}  loss {s['loss']:.4f}  "
                f"gen {s['generation']}  workers {s['workers']}  "
                f"min replicas {s['lowest_replicas']}  {s['step'] / elapsed:.1f} steps/s")
        if self.tty:
            self.last_line = "\r\033[K" + line
            sys.stderr.write(self.last_line)
            sys.stderr.flush()
        elif s["step"] % 5 == 0:
            self.event(line)

    def finish(self, r) -> None:
        if self.tty:
            sys.stderr.write("\n")
        print(f"completed {r.steps_completed} steps in {r.wall_seconds:.1f} s "
              f"({r.tokens_per_second:.0f} tokens/s) on {r.workers} workers, generation "
              f"{r.generation}")
        print(f"failures injected: {r.failures}; reconfigurations: {len(r.reconfigurations)}; "
              f"checkpoint restores: {r.checkpoint_restores}; steps redone: {r.steps_redone}; "
              f"samples lost: {r.samples_lost}; duplicated: {r.samples_duplicated}")
        for rc in r.reconfigurations:
            b = rc["breakdown"]
            print(f"  generation {rc['generation']} ({rc['reason']}): recovered in "
                  f"{rc['seconds']:.2f} s = detect {b['detection_s']:.2f} + plan "
                  f"{b['replanning_s']:.3f} + regroup {b['communication_rebuild_s']:.2f} + "
                  f"migrate {b['migration_s']:.2f} ({rc['experts_migrated']} replicas) + "
                  f"redo {b['redone_step_s']:.2f}")
        print("loss by step: " + " ".join(f"{x:.3f}" for x in r.losses))
