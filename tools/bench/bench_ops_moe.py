"""MoE dispatch and loss benchmarks on one GPU, each against a baseline of the same run.

- dispatch planning (per-expert counts, per-EP-rank deduplicated counts, counting sort,
  inverse) against the eager sequence that makes the same fields (bincount, stable argsort,
  inverse scatter, scattered rank mask, sum) at 16k tokens × top-8 of 128 experts on 8 EP
  ranks: wall time per call (ours is one launch, whose host time is most of it) and GPU
  kernel time alone;
- permute and unpermute (forward and backward) GB/s against a device-to-device copy;
- fused SwiGLU forward + backward against eager;
- chunked linear cross-entropy time and peak memory against eager fp32 logits.

Run: ``PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 tools/bench/bench_ops_moe.py``
"""

import argparse
import itertools

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import mt_ops.moe_permute as moe_permute
import mt_ops.moe_plan as moe_plan
from mt_ops import linear_cross_entropy, permute, plan_dispatch, swiglu, unpermute
from mt_ops.moe_permute import permute_reference, unpermute_reference


def bench_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def kernel_us(fn, calls: int = 10) -> float:
    """GPU kernel time of one call (profiler sum), without host launch and sync time."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(event.self_device_time_total for event in prof.key_averages()) / calls


def eager_plan(topk_ids_TK, num_experts, num_ranks):
    """The fields of a DispatchPlan in eager ops, as ``plan_dispatch_reference`` makes them
    (without its range check). Only what ``plan_dispatch`` returns: the EP dispatcher's send
    order (a second plan, over ranks) is made by the caller on both paths."""
    ids = topk_ids_TK.reshape(-1)
    counts = torch.bincount(ids, minlength=num_experts)
    sorted_slot = torch.argsort(ids, stable=True)
    row_of_slot = torch.empty_like(sorted_slot)
    row_of_slot[sorted_slot] = torch.arange(ids.numel(), device=ids.device)
    sorted_token = sorted_slot // topk_ids_TK.shape[1]
    rank = topk_ids_TK // (num_experts // num_ranks)
    to_rank = torch.zeros(topk_ids_TK.shape[0], num_ranks, dtype=torch.bool, device=ids.device)
    to_rank.scatter_(1, rank, True)  # [T, P] dedup
    per_rank = to_rank.sum(0)
    return counts, sorted_token, sorted_slot, row_of_slot, per_rank, to_rank


def planning(copy_gbs: float) -> None:
    num_tokens, num_experts, topk, num_ranks = 16384, 128, 8, 8
    scores = torch.rand(num_tokens, num_experts, device="cuda")
    topk_ids = scores.topk(topk, dim=-1).indices
    runs = {
        "eager": lambda: eager_plan(topk_ids, num_experts, num_ranks),
        "ours": lambda: plan_dispatch(topk_ids, num_experts, num_ranks=num_ranks),
    }
    wall = {name: bench_ms(fn) * 1e3 for name, fn in runs.items()}
    device = {name: kernel_us(fn) for name, fn in runs.items()}
    print(
        f"plan T={num_tokens} K={topk} E={num_experts} P={num_ranks}: wall eager "
        f"{wall['eager']:6.1f} us | ours {wall['ours']:6.1f} us = "
        f"{wall['eager'] / wall['ours']:.1f}x || GPU kernel time eager {device['eager']:6.1f} us"
        f" | ours {device['ours']:6.1f} us = {device['eager'] / device['ours']:.1f}x"
    )  # fmt: skip
    plan = plan_dispatch(topk_ids, num_experts, num_ranks=num_ranks)
    weights = torch.rand(num_tokens, topk, device="cuda", requires_grad=True)
    x = torch.randn(num_tokens, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    routed_bytes = num_tokens * topk * 2048 * 2
    token_bytes = num_tokens * 2048 * 2
    y = torch.randn(num_tokens * topk, 2048, device="cuda", dtype=torch.bfloat16)
    y.requires_grad_(True)
    grad_routed = torch.randn_like(y)
    grad_tokens = torch.randn(num_tokens, 2048, device="cuda", dtype=torch.bfloat16)

    def reset():  # leaf gradients would otherwise accumulate: one more pass over R×D
        x.grad = y.grad = weights.grad = None

    # Bytes an op must move: each input read once, each output written once (a lower bound
    # on DRAM traffic, as for the copy). Permute's forward reads each token row once and
    # writes it K times; the eager index_select reads it K times, partly from L2, which
    # counting R·D reads would credit as DRAM bandwidth.
    cases = [
        ("permute fwd", lambda f: f[0](x, plan), token_bytes + routed_bytes),
        ("permute fwd+bwd", lambda f: (reset(), f[0](x, plan).backward(grad_routed)),
         token_bytes + routed_bytes + routed_bytes + token_bytes),
        ("unpermute fwd", lambda f: f[1](y, plan, weights), routed_bytes + token_bytes),
        ("unpermute fwd+bwd", lambda f: (reset(), f[1](y, plan, weights).backward(grad_tokens)),
         routed_bytes + token_bytes + token_bytes + 2 * routed_bytes),
    ]  # fmt: skip
    for name, fn, nbytes in cases:
        ours = bench_ms(lambda fn=fn: fn((permute, unpermute)))
        ref = bench_ms(lambda fn=fn: fn((permute_reference, unpermute_reference)))
        gbs = nbytes / ours / 1e6
        print(f"{name:18s}: ours {ours * 1e3:7.1f} us {gbs:6.0f} GB/s = {gbs / copy_gbs:.2f}x copy"
              f" | eager {ref * 1e3:7.1f} us ({ref / ours:.2f}x)")  # fmt: skip


def permute_kernels(x_TD, y_RD, plan, weights_TK) -> dict:
    """The three permute kernels, called as the ops call them, by their PERMUTE_CONFIG prefix:
    the permute (all T·K rows), the gather-sum (unpermute forward) and the unpermute backward
    (x_TD as the output gradient)."""
    num_rows = plan.num_tokens * plan.topk
    return {
        "fwd_": lambda: moe_permute._scatter_rows(x_TD, plan, num_rows),
        "": lambda: moe_permute._gather_sum(y_RD, plan, weights_TK),
        "bwd_": lambda: moe_permute._unpermute_backward(x_TD, y_RD, plan, weights_TK),
    }


def sweep() -> None:
    """Times the planning kernel's warps and counts rows per step (GPU time) and each
    PERMUTE_CONFIG pair (columns per step, warps) of the three permute kernels at the
    planning shapes, prints them, and leaves the fastest in the configs."""
    num_tokens, num_experts, topk, dim = 16384, 128, 8, 2048
    topk_ids = torch.rand(num_tokens, num_experts, device="cuda").topk(topk, dim=-1).indices
    plan_config, times = moe_plan.PLAN_CONFIG, {}
    for warps, block_q in itertools.product((4, 8), (32, 128)):
        plan_config["warps"], plan_config["block_q"] = warps, block_q
        times[warps, block_q] = kernel_us(lambda: plan_dispatch(topk_ids, num_experts, num_ranks=8))
    best = min(times, key=times.get)
    plan_config["warps"], plan_config["block_q"] = best
    listed = ", ".join(f"{w}/{q}: {us:.1f}" for (w, q), us in times.items())
    print(f"sweep plan (warps/count rows: GPU us) {listed} -> best {best}")
    plan = plan_dispatch(topk_ids, num_experts)
    x = torch.randn(num_tokens, dim, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(num_tokens * topk, dim, device="cuda", dtype=torch.bfloat16)
    weights = torch.rand(num_tokens, topk, device="cuda")
    config = moe_permute.PERMUTE_CONFIG
    for prefix, fn in permute_kernels(x, y, plan, weights).items():
        times = {}
        for block_d in (512, 1024, 2048):
            for warps in (2, 4, 8):
                config[f"{prefix}BLOCK_D"], config[f"{prefix}warps"] = block_d, warps
                times[block_d, warps] = bench_ms(fn) * 1e3
        best = min(times, key=times.get)
        config[f"{prefix}BLOCK_D"], config[f"{prefix}warps"] = best
        listed = ", ".join(f"{b}/{w}: {us:.1f}" for (b, w), us in times.items())
        print(f"sweep {prefix or 'gather_sum_'}(BLOCK_D/warps: us) {listed} -> best {best}")


def swiglu_bench() -> None:
    gate = torch.randn(131072, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn_like(gate, requires_grad=True)
    grad = torch.randn_like(gate)

    def reset():  # else each call adds into gate.grad and up.grad: 3 more passes over each
        gate.grad = up.grad = None

    ours = bench_ms(lambda: (reset(), swiglu(gate, up).backward(grad)))
    eager = bench_ms(lambda: (reset(), (F.silu(gate) * up).backward(grad)))
    print(f"swiglu fwd+bwd [131072,768] bf16: ours {ours * 1e3:7.1f} us | eager "
          f"{eager * 1e3:7.1f} us ({eager / ours:.2f}x)")  # fmt: skip


def cross_entropy() -> None:
    num_tokens, dim, vocab = 8192, 2048, 151936
    hidden = torch.randn(num_tokens, dim, device="cuda", dtype=torch.bfloat16) * 0.5
    hidden.requires_grad_(True)
    weight = (torch.randn(vocab, dim, device="cuda") * dim**-0.5).bfloat16().requires_grad_(True)
    labels = torch.randint(0, vocab, (num_tokens,), device="cuda")

    def ours():
        hidden.grad = weight.grad = None  # else each call adds into the [V, D] weight.grad
        loss, count = linear_cross_entropy(hidden, weight, labels)
        (loss / count).backward()

    def eager():
        hidden.grad = weight.grad = None
        logits = (hidden @ weight.T).float()
        F.cross_entropy(logits, labels).backward()

    results = {}
    for name, fn in (("ours", ours), ("eager", eager)):
        fn()
        hidden.grad = weight.grad = None  # the peak counts the gradients each side makes
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        results[name] = (bench_ms(fn), peak)
    (t_ours, m_ours), (t_eager, m_eager) = results["ours"], results["eager"]
    print(f"linear CE fwd+bwd T={num_tokens} V={vocab}: ours {t_ours:6.2f} ms peak +{m_ours:.2f} "
          f"GiB | eager {t_eager:6.2f} ms peak +{m_eager:.2f} GiB ({t_eager / t_ours:.2f}x time, "
          f"{m_eager / max(m_ours, 1e-9):.1f}x memory)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="first time the planning and permute kernels' configs; the run uses the fastest",
    )
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_gbs = 2 * src.numel() * 2 / bench_ms(lambda: dst.copy_(src)) / 1e6
    print(f"copy bandwidth (read + write): {copy_gbs:.0f} GB/s")
    sections = [lambda: planning(copy_gbs), swiglu_bench, cross_entropy]
    for section in [sweep] * args.sweep + sections:
        try:
            section()
        except Exception as err:  # noqa: BLE001 - report and go on to the next section
            print(f"FAILED: {type(err).__name__}: {err}"[:400])


if __name__ == "__main__":
    main()
