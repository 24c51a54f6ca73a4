"""Permute and unpermute throughput as a fraction of torch copy_ bandwidth on the same tensors.

Legend: T tokens, K top-k, D hidden size, B buckets, P = T*K permuted rows.

Bandwidth counts every byte an op must move once: permute reads x_TD and rows_TK and writes
x_PD; unpermute reads y_PD, rows_TK and weights_TK and writes out_TD. The copy_ baseline copies
the op's large tensor (x_PD or y_PD) into a buffer of the same shape. On CUDA the Triton
kernels and the torch reference are both measured; on CPU only the torch reference, because
Triton's interpreter says nothing about speed.

    python benchmarks/bench_dispatch_kernels.py        # CUDA: the issue's shapes; CPU: one small
    python benchmarks/bench_dispatch_kernels.py --shape 16384,2,4096,64 --dtype bfloat16

Targets (issue 13): the Triton rows >= 0.70 of copy_ at every shape; before the 1-D row
tiles, unpermute reached 0.40 at T=32768 K=8 D=7168 (gpu-notes.md).
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from lazarus_runtime.kernels import kernel_backend
from lazarus_runtime.kernels.combine import combine_triton, unpermute_reference
from lazarus_runtime.kernels.counts import bucket_positions_reference
from lazarus_runtime.kernels.scatter import permute_reference, scatter_triton


def median_seconds(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up: compiles the kernel, touches the memory
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# The shapes issue 13 names: top-2 at a 4096 hidden size, and DeepSeek-V3's top-8 at 7168.
CUDA_SHAPES = ((16384, 2, 4096, 64), (32768, 8, 7168, 256))
CPU_SHAPES = ((4096, 2, 1024, 64),)


def parse_shape(text: str) -> tuple[int, int, int, int]:
    try:
        tokens, top_k, hidden, buckets = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape: want T,K,D,B such as 16384,2,4096,64, got {text!r}") from None
    return tokens, top_k, hidden, buckets


def bench_shape(num_tokens: int, top_k: int, hidden: int, buckets: int, dtype: torch.dtype,
                device: torch.device, repeats: int) -> list[dict]:
    """Print one shape's rows; return them as dicts (for --json)."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    ids_TK = torch.randint(0, buckets, (num_tokens, top_k), generator=gen)
    rows_TK = bucket_positions_reference(ids_TK, buckets)[0].to(device)
    x_TD = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)
    y_PD = torch.randn(num_tokens * top_k, hidden, generator=gen).to(device, dtype)
    weights_TK = torch.rand(num_tokens, top_k, generator=gen).to(device, dtype)

    impls = {"torch": (permute_reference, unpermute_reference)}
    if device.type == "cuda":
        impls["triton"] = (scatter_triton, combine_triton)

    print(f"T={num_tokens} K={top_k} D={hidden} B={buckets} {dtype} on {device}")
    print(f"{'op':<10} {'impl':<7} {'ms':>9} {'GB/s':>8} {'copy_ GB/s':>11} {'of copy_':>9}")
    with torch.no_grad():
        for op in ("permute", "unpermute"):
            big = x_TD.repeat_interleave(top_k, 0) if op == "permute" else y_PD
            buffer = torch.empty_like(big)
            copy_s = median_seconds(lambda: buffer.copy_(big), device, repeats)
            copy_gbps = 2 * nbytes(big) / copy_s / 1e9
            for impl, (permute_fn, unpermute_fn) in impls.items():
                if op == "permute":
                    run = lambda: permute_fn(x_TD, rows_TK)  # noqa: E731
                    moved = nbytes(x_TD, rows_TK, big)
                else:
                    run = lambda: unpermute_fn(y_PD, rows_TK, weights_TK)  # noqa: E731
                    moved = nbytes(y_PD, rows_TK, weights_TK, x_TD)
                seconds = median_seconds(run, device, repeats)
                gbps = moved / seconds / 1e9
                fraction = gbps / copy_gbps
                print(f"{op:<10} {impl:<7} {seconds * 1e3:>9.3f} {gbps:>8.1f} {copy_gbps:>11.1f} {fraction:>9.2f}")
                rows.append({"shape": f"T={num_tokens} K={top_k} D={hidden} B={buckets}", "op": op,
                             "impl": impl, "ms": seconds * 1e3, "of_copy": fraction})
    del x_TD, y_PD, big, buffer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=parse_shape, action="append",
                        help="T,K,D,B (repeatable); default the issue's two shapes on CUDA, "
                        "4096,2,1024,64 on CPU")
    parser.add_argument(
        "--dtype", choices=["float32", "float16", "bfloat16"], help="default bfloat16 on CUDA, float32 on CPU"
    )
    parser.add_argument("--repeats", type=int, help="timed runs per row (default 50 on CUDA, 5 on CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", help="also write the rows to this file as JSON")
    args = parser.parse_args()

    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_cuda else "float32"))
    repeats = args.repeats or (50 if on_cuda else 5)
    print(f"kernel_backend()={kernel_backend()}")
    rows = [row for shape in args.shape or (CUDA_SHAPES if on_cuda else CPU_SHAPES)
            for row in bench_shape(*shape, dtype, device, repeats)]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))

if __name__ == "__main__":
    main()
