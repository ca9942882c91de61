"""Host time against GPU time of the fused FP8 expert MLP step, on one GPU.

Is the step bound by the GPU or by the host that launches its kernels? For each expert
shape of ``bench_ops_fp8.py`` (balanced routing, 16k tokens) this prints, per
forward + backward step of ``fp8_swiglu_experts``:

- the host time to launch it, with the GPU queue kept busy (steps back to back, timed
  before the final synchronize);
- the wall time per step of the same steps back to back, and ``do_bench``'s median;
- the host time of one step launched onto an idle GPU.

Host time well below wall time means the GPU bounds the step; ``--profile`` adds the
Python profile (cumulative time) of 20 steps.

Run: ``PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 tools/bench/bench_mlp_host.py``
"""

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_ops_fp8 as fp8_bench  # noqa: E402 - the shapes and experts of the FP8 bench

from mt_ops.fp8_expert_mlp import fp8_swiglu_experts  # noqa: E402
from mt_ops.fp8_linear import FP8WeightCache  # noqa: E402


def measure(name: str, num_tokens: int, profile: bool) -> None:
    num_experts, topk, dim, _ = fp8_bench.SHAPES[name]
    rows = num_tokens * topk
    counts = fp8_bench.counts_for(rows, num_experts, False)
    x = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16)
    projs = fp8_bench._experts(name, True, FP8WeightCache())

    def step() -> None:
        fp8_swiglu_experts(x, counts, *projs).backward(grad)
        x.grad = None
        for proj in projs:
            proj.weight.grad = None

    for _ in range(10):
        step()
    torch.cuda.synchronize()
    n = 30
    start = time.perf_counter()
    for _ in range(n):
        step()
    launched = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    idle = []
    for _ in range(10):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        idle.append(time.perf_counter() - t)
    print(
        f"{name:17s} T={num_tokens}: host {1e3 * (launched - start) / n:.2f} ms/step, wall "
        f"{1e3 * (done - start) / n:.2f} ms/step back to back (do_bench "
        f"{fp8_bench.bench_ms(step):.2f}) | one step onto an idle GPU: host "
        f"{1e3 * sorted(idle)[len(idle) // 2]:.2f} ms"
    )
    if profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(20):
            step()
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("cumtime").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per step")
    parser.add_argument("--profile", action="store_true", help="print the Python profile")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    for name in fp8_bench.SHAPES:
        measure(name, args.tokens, args.profile)


if __name__ == "__main__":
    main()
