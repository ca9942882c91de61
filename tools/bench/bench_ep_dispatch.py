#!/usr/bin/env python3
"""Overhead of the expert-parallel dispatcher against the local one, on one GPU.

At ep = 1 the expert-parallel dispatcher still runs its whole path (deduplication,
size exchange, four all-to-alls through NCCL, expert-side planning and pre-summing),
so the difference to the local dispatcher is its fixed cost. Shapes: one MoE layer of
Qwen3-30B-A3B (D 2048, 128 experts, top-8, expert hidden 768) over 16k tokens, BF16,
forward + backward of dispatch → experts → combine.

Usage (on a GPU machine, from the repository root):
    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python tools/bench/bench_ep_dispatch.py
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from mt_models import Routed
from mt_models.dispatch import LocalDispatcher
from mt_models.layers.experts import SwiGLUExperts
from mt_parallel.expert_parallel import ExpertParallelDispatcher


def _time(fn, warmup: int = 3, iters: int = 10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    device, dtype = torch.device("cuda"), torch.bfloat16
    experts = SwiGLUExperts(args.experts, args.dim, args.hidden).to(device, dtype)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    hidden = torch.randn(args.tokens, args.dim, device=device, dtype=dtype, requires_grad=True)
    logits = torch.randn(args.tokens, args.experts, device=device)
    weights, ids = torch.softmax(logits, -1).topk(args.topk, dim=-1)
    weights = weights.requires_grad_()

    def step(dispatcher):
        routed = Routed(
            hidden_TD=hidden,
            residual_TD=hidden,
            batch_shape=(1, args.tokens),
            topk_ids_TK=ids,
            topk_weights_TK=weights,
        )
        tokens, counts, handle = dispatcher.dispatch(routed)
        out = dispatcher.combine(experts(tokens, counts), handle)
        out.float().square().mean().backward()
        # Else each step adds into the experts' weight gradients (1.2 GB in BF16 at the
        # default shapes), the same time on both sides, which pulls the ratio toward 1.
        hidden.grad = weights.grad = None
        experts.zero_grad(set_to_none=True)

    local = _time(lambda: step(LocalDispatcher(args.experts)))
    ep = _time(lambda: step(ExpertParallelDispatcher(args.experts, dist.group.WORLD)))
    ep_sync = _time(
        lambda: step(ExpertParallelDispatcher(args.experts, dist.group.WORLD, async_comm=False))
    )
    print(
        f"MoE layer fwd+bwd, T={args.tokens} D={args.dim} E={args.experts} K={args.topk} "
        f"F={args.hidden} bf16"
    )
    print(f"  local dispatcher                {local:8.3f} ms")
    for name, ms in (("async", ep), ("sync", ep_sync)):
        print(
            f"  expert-parallel (ep=1, {name:5s}) {ms:8.3f} ms   ratio {ms / local:.3f}x "
            f"(overhead {ms - local:+.3f} ms)"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
