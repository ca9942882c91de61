"""Attention benchmark on one GPU: the paths of ``mt_ops.attention`` against baselines of the
same run, forward + backward time and peak memory.

GPT-OSS attention (64 query heads, 8 key/value heads, head dim 64, learned sinks, a
128-token sliding window on every other layer) at 4k and 8k tokens:

- sinks with and without the window, through compiled ``flex_attention`` (the default on
  CUDA) against the O(S²) fp32 reference it replaced (``FLEX["enabled"] = False``);
- the log-sum-exp request of context parallelism (no sinks), flex against the reference;
- the window and packed documents (four per row) without sinks, flex (the default on
  CUDA) against SDPA with a boolean mask (``FLEX["masks"] = "none"``);
- plain causal SDPA (Flash) with no sinks as the speed of light.

And the rotary embedding of Qwen3-30B-A3B's queries and keys (4 × 4096 tokens, 32 query and
4 key heads of 128): the fused ``apply_rope`` against ``apply_rope_reference`` (the eager
ops it replaced), forward + backward, with GB/s against a device-to-device copy.

And RMSNorm, forward + backward, with GB/s against a copy likewise: Qwen3's q_norm (the
queries above, bf16, with an fp32 weight as under autocast) and a hidden-state norm
(16384 tokens of 2048, fp32, and bf16 with a bf16 weight), the fused ``rms_norm`` against
``rms_norm_reference`` and against the composition around ``F.rms_norm`` it replaced.

Run: ``PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 tools/bench/bench_ops_attention.py``
"""

import argparse
import importlib

import torch
from triton.testing import do_bench

from mt_ops import apply_rope, apply_rope_reference, attention, rms_norm, rms_norm_reference
from mt_ops.rms_norm import _rms_norm_eager

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


def _documents(seq: int) -> torch.Tensor:
    """Document ids of one packed row: four documents of 1/2, 1/4, 1/8 and 1/8 of it."""
    lengths = torch.tensor([seq // 2, seq // 4, seq // 8, seq - seq // 2 - seq // 4 - seq // 8])
    return torch.repeat_interleave(torch.arange(4), lengths).cuda()


def _measure(seq: int, kwargs: dict, flex: bool, masks: str = "auto") -> tuple[float, float]:
    """(ms, peak GiB) of one forward + backward, or (nan, nan) when it runs out of memory."""
    q, k, v, sinks = _inputs(seq)
    if "sinks" in kwargs:
        kwargs = {**kwargs, "sinks": sinks}
    if kwargs.get("q_document_ids") == "packed":
        kwargs = {**kwargs, "q_document_ids": _documents(seq), "kv_document_ids": _documents(seq)}
    attention_module.FLEX.update(enabled=flex, masks=masks)
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
        attention_module.FLEX.update(enabled=True, masks="auto")
        torch.cuda.empty_cache()


def rope() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    batch, seq, head_dim = 4, 4096, 128
    angles = torch.arange(seq, device="cuda")[:, None] * 1e6 ** (
        -torch.arange(0, head_dim, 2, device="cuda") / head_dim
    )
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    q, k = (
        torch.randn(batch, seq, h, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
        for h in (32, 4)
    )
    grads = [torch.randn_like(q), torch.randn_like(k)]
    leaves = [q.requires_grad_(True), k.requires_grad_(True)]

    def step(fn):
        for x, g in zip(leaves, grads, strict=True):
            x.grad = None
            fn(x, cos, sin).backward(g)

    moved = 4 * sum(x.numel() * x.element_size() for x in leaves)  # fwd and bwd: read + write
    copy_src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    copy_ms = do_bench(lambda: copy_dst.copy_(copy_src))
    ours, eager = do_bench(lambda: step(apply_rope)), do_bench(lambda: step(apply_rope_reference))
    print(
        f"RoPE q+k fwd+bwd {tuple(q.shape)}, {tuple(k.shape)}: fused {ours * 1e3:7.1f} us "
        f"({moved / ours / 1e6:6.0f} GB/s, {copy_ms / ours:4.2f}x copy) | eager "
        f"{eager * 1e3:7.1f} us | {eager / ours:4.1f}x faster"
    )


def _rmsnorm_case(label: str, shape: tuple[int, ...], x_dtype, w_dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(shape, device="cuda", generator=gen, dtype=x_dtype).requires_grad_(True)
    w = (1 + 0.1 * torch.randn(shape[-1], device="cuda", generator=gen)).to(w_dtype)
    w.requires_grad_(True)
    grad = torch.randn_like(x)

    def step(fn):
        x.grad = w.grad = None
        fn(x, w, 1e-6).backward(grad)

    moved = 5 * x.numel() * x.element_size()  # fwd: read x, write y; bwd: read x, g, write dx
    copy_src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
    copy_dst = torch.empty_like(copy_src)
    copy_ms = do_bench(lambda: copy_dst.copy_(copy_src))
    ours, reference = do_bench(lambda: step(rms_norm)), do_bench(lambda: step(rms_norm_reference))
    old = do_bench(lambda: step(_rms_norm_eager))
    dtypes = f"{str(x_dtype)[6:]} x, {str(w_dtype)[6:]} weight"
    print(
        f"RMSNorm {label} fwd+bwd {shape}, {dtypes}: fused {ours * 1e3:7.1f} us "
        f"({moved / ours / 1e6:6.0f} GB/s, {copy_ms / ours:4.2f}x copy) | reference "
        f"{reference * 1e3:7.1f} us | F.rms_norm path {old * 1e3:7.1f} us | "
        f"{old / ours:4.1f}x faster than it"
    )


def rmsnorm() -> None:
    _rmsnorm_case("q_norm", (4, 4096, 32, 128), torch.bfloat16, torch.float32)
    _rmsnorm_case("hidden", (16384, 2048), torch.float32, torch.float32)
    _rmsnorm_case("hidden", (16384, 2048), torch.bfloat16, torch.bfloat16)
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--seqs", default="4096,8192", help="comma-separated sequence lengths")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    rope()
    rmsnorm()
    cases = (
        ("sinks, full causal", {"causal": True, "sinks": None}),
        (f"sinks, window {WINDOW}", {"causal": True, "sinks": None, "window": WINDOW}),
        ("LSE request (CP)", {"causal": True, "return_lse": True}),
    )
    masked = (
        (f"window {WINDOW}, no sinks", {"causal": True, "window": WINDOW}),
        ("4 documents, no sinks", {"causal": True, "q_document_ids": "packed"}),
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
        for label, kwargs in masked:
            ms_flex, gib_flex = _measure(seq, kwargs, flex=True)
            ms_sdpa, gib_sdpa = _measure(seq, kwargs, flex=True, masks="none")
            print(
                f"S={seq}: {label:20s} flex {ms_flex:7.2f} ms {gib_flex:5.2f} GiB | SDPA bool mask "
                f"{ms_sdpa:7.2f} ms {gib_sdpa:6.2f} GiB | flex {ms_sdpa / ms_flex:5.2f}x faster, "
                f"{gib_sdpa / gib_flex:5.2f}x less memory | {ms_flex / light:4.2f}x SDPA time"
            )


if __name__ == "__main__":
    main()
