"""Attention benchmark on one GPU: the paths of ``mt_ops.attention`` against baselines of the
same run, forward + backward time and peak memory.

GPT-OSS attention (64 query heads, 8 key/value heads, head dim 64, learned sinks, a
128-token sliding window on every other layer) at 4k and 8k tokens:

- sinks with and without the window, through compiled ``flex_attention`` (the default on
  CUDA) against the O(S²) fp32 reference it replaced (``FLEX["enabled"] = False``);
- the log-sum-exp request of context parallelism (no sinks), flex against the reference;
- plain causal SDPA (Flash) with no sinks as the speed of light.

Run: ``PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 tools/bench/bench_ops_attention.py``
"""

import argparse
import importlib

import torch
from triton.testing import do_bench

from mt_ops import attention

# The module (the package exports the function under the same name): its FLEX switch.
attention_module = importlib.import_module("mt_ops.attention")

HEADS_Q, HEADS_KV, HEAD_DIM, WINDOW = 64, 8, 64, 128


def _inputs(seq: int):
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        x = torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16)
        return x.requires_grad_(True)

    q = randn(1, HEADS_Q, seq, HEAD_DIM)
    k = randn(1, HEADS_KV, seq, HEAD_DIM)
    v = randn(1, HEADS_KV, seq, HEAD_DIM)
    sinks = torch.randn(HEADS_Q, device="cuda", generator=gen).requires_grad_(True)
    return q, k, v, sinks


def _step(q, k, v, kwargs):
    result = attention(q, k, v, **kwargs)
    out = result[0] if isinstance(result, tuple) else result
    loss = out.float().square().mean()
    if isinstance(result, tuple):
        loss = loss + result[1].float().mean()
    loss.backward()


def _measure(seq: int, kwargs: dict, flex: bool) -> tuple[float, float]:
    """(ms, peak GiB) of one forward + backward, or (nan, nan) when it runs out of memory."""
    q, k, v, sinks = _inputs(seq)
    if "sinks" in kwargs:
        kwargs = {**kwargs, "sinks": sinks}
    attention_module.FLEX["enabled"] = flex
    try:
        _step(q, k, v, kwargs)  # compile / warm up
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _step(q, k, v, kwargs)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        ms = do_bench(lambda: _step(q, k, v, kwargs), warmup=5, rep=50, return_mode="median")
        return ms, peak
    except torch.OutOfMemoryError:
        return float("nan"), float("nan")
    finally:
        attention_module.FLEX["enabled"] = True
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="4096,8192", help="comma-separated sequence lengths")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    cases = (
        ("sinks, full causal", {"causal": True, "sinks": None}),
        (f"sinks, window {WINDOW}", {"causal": True, "sinks": None, "window": WINDOW}),
        ("LSE request (CP)", {"causal": True, "return_lse": True}),
    )
    for seq in (int(s) for s in args.seqs.split(",")):
        light, light_gib = _measure(seq, {"causal": True}, flex=True)
        print(f"S={seq}: plain causal SDPA (no sinks) {light:7.2f} ms, {light_gib:5.2f} GiB")
        for label, kwargs in cases:
            ms_flex, gib_flex = _measure(seq, kwargs, flex=True)
            ms_ref, gib_ref = _measure(seq, kwargs, flex=False)
            print(
                f"S={seq}: {label:20s} flex {ms_flex:7.2f} ms {gib_flex:5.2f} GiB | reference "
                f"{ms_ref:7.2f} ms {gib_ref:6.2f} GiB | flex {ms_ref / ms_flex:5.1f}x faster, "
                f"{gib_ref / gib_flex:5.1f}x less memory | {ms_flex / light:4.2f}x SDPA time"
            )


if __name__ == "__main__":
    main()
