"""One rank's training step: Lazarus's engine beside a plain PyTorch MoE, eager and compiled.

For each model and tokens-per-rank it prints the step time, tokens/s, TFLOP/s, MFU against
the device's dense bf16 peak, peak memory and host synchronisations per step, of:
- ``lazarus``: the engine at world size 1 (local dispatcher), as a worker runs it, with the
  compute options given (``--compile dense`` adds a row with the dense blocks compiled);
- ``plain eager`` and ``plain compiled``: the same architecture and precision written the
  obvious way (plain_moe.py), eager and under ``torch.compile``;
and, last, the ratio of each row's step time to the compiled plain one.

FLOPs per step count 6 x active parameters (without the embeddings) x tokens, plus
12 x layers x dim x seq_len x tokens for attention, as gpu-notes.md did. Host syncs: on a
GPU, CUDA's own count (sync debug mode) over one step; on a CPU, the emulated count of
host_sync.HostSyncCounter. Peak memory: allocated device memory on a GPU, the process's
peak RSS on a CPU (the whole run so far, so only the GPU figure is per row).

    python benchmarks/bench_train_step.py                  # CUDA: gpt-s, gpt-l at 8K, 32K
    python benchmarks/bench_train_step.py --models tiny --tokens 512      # CPU defaults

Targets (issue 13), on one H200: gpt-l bf16 at 32K tokens MFU >= 30%, lazarus / plain
compiled <= 1.0, host syncs per step <= 12.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from lazarus_core.runtime_config import (NAMED_MODELS, ComputeConfig, DataConfig, ModelConfig,
                                         RuntimeConfig)
from lazarus_core.solver import plan_job
from lazarus_core.topology import NodeSpec
from lazarus_runtime.collectives import Collectives
from lazarus_runtime.data import StepBatches
from lazarus_runtime.engine import Engine, peak_memory_bytes
from lazarus_runtime.host_sync import HostSyncCounter, count_cuda_syncs
from plain_moe import PlainTrainer

# Dense bf16 tensor-core peaks, TFLOP/s, from NVIDIA's datasheets (SXM parts).
BF16_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def device_peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in BF16_PEAK_TFLOPS.items() if key in name), None)


def flops_per_step(m: ModelConfig, tokens: int) -> float:
    active = m.layers * (4 * m.dim**2 + m.dim * m.experts + m.top_k * 2 * m.dim * m.ffn_dim)
    active += m.vocab * m.dim  # the output head
    return 6 * active * tokens + 12 * m.layers * m.dim * m.seq_len * tokens


@dataclass
class Row:
    model: str
    tokens: int
    impl: str
    seconds: float
    peak_bytes: int
    host_syncs: int


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step, device: torch.device, warmup: int, steps: int) -> float:
    """Median wall time of ``step(i)`` after ``warmup`` calls."""
    for i in range(warmup):
        step(i)
    times = []
    for i in range(warmup, warmup + steps):
        _synchronize(device)
        start = time.perf_counter()
        step(i)
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def count_syncs(step, device: torch.device, resident=()) -> int:
    """Host synchronisations of one call of ``step``: CUDA's count on a GPU, else the
    emulated one."""
    if device.type == "cuda":
        with count_cuda_syncs() as found:
            step()
        return len(found)
    counter = HostSyncCounter(device, on_device=resident)
    with counter:
        step()
    return counter.total()


def _fresh_peak(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def bench_lazarus(name: str, cfg: RuntimeConfig, token_counts, device, args) -> list[Row]:
    rows = []
    world = plan_job([NodeSpec("solo", gpus=1, slots_per_gpu=cfg.model.experts)],
                     experts=cfg.model.experts, layers=cfg.model.layers, min_replicas=1)
    engine = Engine(cfg, world, 0, Collectives.single(), device=device)
    label = "lazarus" + (" compile=dense" if cfg.compute.compile == "dense" else "")
    for tokens in token_counts:
        engine.batches = batches_for(cfg.model, tokens, args)
        _fresh_peak(device)
        seconds = timed(engine.step, device, args.warmup, args.steps)
        syncs = count_syncs(lambda: engine.step(args.warmup + args.steps), device,
                            engine.resident_tensors())
        rows.append(Row(name, tokens, label, seconds, peak_memory_bytes(device), syncs))
    del engine
    return rows


def bench_plain(name: str, cfg: RuntimeConfig, token_counts, device, args,
                compiled: bool) -> list[Row]:
    rows = []
    precision = cfg.compute.precision_on(device.type)
    trainer = PlainTrainer(cfg.model, device, precision, cfg.optim.lr, compiled)
    for tokens in token_counts:
        batches = batches_for(cfg.model, tokens, args)

        def step(i: int) -> None:
            batch = batches.batch(i, 0, 1)
            trainer.step(batch.inputs_BS, batch.targets_BS)

        _fresh_peak(device)
        seconds = timed(step, device, args.warmup, args.steps)
        syncs = count_syncs(lambda: step(args.warmup + args.steps), device,
                            list(trainer.model.parameters()))
        rows.append(Row(name, tokens, "plain " + ("compiled" if compiled else "eager"), seconds,
                        peak_memory_bytes(device), syncs))
    del trainer
    if compiled:
        torch._dynamo.reset()  # its compiled graphs hold the model's memory otherwise
    return rows


def batches_for(m: ModelConfig, tokens: int, args) -> StepBatches:
    if tokens % m.seq_len:
        raise SystemExit(f"--tokens: {tokens} is not a multiple of seq_len {m.seq_len}")
    # A corpus long enough that every step of the run sees new samples.
    data = DataConfig(global_batch=tokens // m.seq_len,
                      generated_tokens=(args.warmup + args.steps + 2) * tokens + 1)
    return StepBatches.from_config(data, m.seq_len, m.vocab)


HEADER = (f"{'model':<7} {'tokens':>6} {'impl':<22} {'step ms':>9} {'tokens/s':>10} "
          f"{'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9} {'syncs':>6} {'/ compiled':>10}")


def print_rows(rows: list[Row], device: torch.device) -> list[dict]:
    """Print one model's rows (against its compiled plain rows); return them as dicts."""
    peak = device_peak_tflops(device)
    reference = {(r.model, r.tokens): r.seconds for r in rows if r.impl == "plain compiled"}
    out = []
    for r in rows:
        tflops = flops_per_step(NAMED_MODELS[r.model], r.tokens) / r.seconds / 1e12
        mfu = f"{100 * tflops / peak:.1f}%" if peak else "-"
        ratio = r.seconds / reference[r.model, r.tokens] if (r.model, r.tokens) in reference \
            else None
        print(f"{r.model:<7} {r.tokens:>6} {r.impl:<22} {r.seconds * 1e3:>9.1f} "
              f"{r.tokens / r.seconds:>10.0f} {tflops:>8.2f} {mfu:>6} "
              f"{r.peak_bytes / 2**30:>9.2f} {r.host_syncs:>6} "
              f"{ratio if ratio is not None else float('nan'):>10.2f}", flush=True)
        out.append({**asdict(r), "tflops": tflops, "mfu": mfu, "per_compiled": ratio})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", help="named models (default gpt-s,gpt-l on CUDA, tiny on CPU)")
    parser.add_argument("--tokens", help="tokens per rank per step, comma-separated "
                        "(default 8192,32768 on CUDA, 512 on CPU)")
    parser.add_argument("--precision", choices=["bf16", "fp32"],
                        help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--activation-checkpointing", default="none",
                        choices=["none", "attention", "full"])
    parser.add_argument("--compile", default="none", choices=["none", "dense"],
                        help="dense: also time Lazarus with its dense blocks compiled")
    parser.add_argument("--no-plain-compile", action="store_true",
                        help="skip the compiled plain model (its compile takes minutes)")
    parser.add_argument("--warmup", type=int, help="untimed steps (default 3 on CUDA, 1 on CPU)")
    parser.add_argument("--steps", type=int, help="timed steps (default 10 on CUDA, 3 on CPU)")
    parser.add_argument("--json", help="also write the rows to this file as JSON")
    args = parser.parse_args()

    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    models = (args.models or ("gpt-s,gpt-l" if on_cuda else "tiny")).split(",")
    token_counts = [int(t) for t in (args.tokens or ("8192,32768" if on_cuda else "512")).split(",")]
    args.warmup = args.warmup if args.warmup is not None else (3 if on_cuda else 1)
    args.steps = args.steps or (10 if on_cuda else 3)
    if not on_cuda:
        torch.set_num_threads(1)  # steadier on a shared CPU

    # Each model's rows are printed (and written) as soon as they are measured, so a run
    # cut short by a time limit keeps what it had.
    where = torch.cuda.get_device_name(device) if on_cuda else "CPU"
    print(f"{ComputeConfig(precision=args.precision).precision_on(device.type)} on {where}, "
          f"torch {torch.__version__}")
    print(HEADER, flush=True)
    table: list[dict] = []
    for name in models:
        if name not in NAMED_MODELS:
            raise SystemExit(f"--models: unknown model {name!r}; choose from {', '.join(NAMED_MODELS)}")
        compute = ComputeConfig(precision=args.precision,
                                activation_checkpointing=args.activation_checkpointing)
        cfg = RuntimeConfig(model=NAMED_MODELS[name], compute=compute)
        rows = bench_lazarus(name, cfg, token_counts, device, args)
        if args.compile == "dense":
            rows += bench_lazarus(name, replace(cfg, compute=replace(compute, compile="dense")),
                                  token_counts, device, args)
        rows += bench_plain(name, cfg, token_counts, device, args, compiled=False)
        if not args.no_plain_compile:
            rows += bench_plain(name, cfg, token_counts, device, args, compiled=True)
        table += print_rows(rows, device)
        if args.json:
            Path(args.json).write_text(json.dumps(table, indent=1))

if __name__ == "__main__":
    main()
