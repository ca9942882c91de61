"""FP8 benchmarks on one GPU: quantization vs copy bandwidth, FP8 GEMMs vs BF16, expert MLP.

Each line prints a ratio against a baseline measured in the same run:

- quantization GB/s (bytes read + written) against a device-to-device copy (the dual
  quantizer by its Gluon kernel on Hopper and, beside it, by the Triton kernel);
- dense and grouped FP8 GEMM TFLOP/s against BF16 (``torch.mm`` / ``torch._grouped_mm``)
  and PyTorch's own rowwise FP8 (``torch._scaled_mm`` / ``torch._scaled_grouped_mm``);
- the grouped expert MLP (gate, up, SwiGLU, down; forward + dgrad + wgrad, activation
  quantization included, weights from a warm per-step cache) in FP8 against BF16, on the
  expert shapes of Qwen3-30B-A3B and DeepSeek-V2-Lite at 16k tokens, balanced and skewed:
  composed from FP8GroupedLinear modules, and as the fused ``fp8_swiglu_experts``; with
  BF16 parameters and gradients on both sides (as FSDP2 mixed precision presents them),
  and the fused op with FP32 master parameters (FP32 gradients), and with a cold cache;
  BF16 and the fused op, whose ratio is the headline, are timed in three alternating
  rounds (medians);
- the expert block (permute, MLP, unpermute) in BF16 against FP8 with the MLP fused and
  with the whole block fused (``fp8_moe_swiglu_experts``: quantization inside the permute
  and inside the unpermute's backward);
- fused SwiGLU + quantization against SwiGLU then quantization.

``--sections`` picks parts (default all); leaving out ``sweep`` (or ``--skip-sweep``) keeps
the configs in the modules instead of sweeping them first.

Run: ``PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 tools/bench/bench_ops_fp8.py``
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from trace_summary import per_call
from triton.testing import do_bench

import mt_ops.fp8_gemm as fp8_gemm
import mt_ops.fp8_quant as fp8_quant
import mt_ops.fp8_swiglu as fp8_swiglu
from mt_ops import (
    GroupedLinear,
    fp8_moe_swiglu_experts,
    fp8_swiglu_experts,
    permute,
    plan_dispatch,
    swiglu,
    unpermute,
)
from mt_ops.fp8_gemm import (
    fp8_grouped_gemm,
    fp8_grouped_gemm_sum,
    fp8_grouped_wgrad,
    fp8_grouped_wgrad_reference,
)
from mt_ops.fp8_linear import FP8GroupedLinear, FP8WeightCache
from mt_ops.fp8_quant import quantize_1x128, quantize_1x128_dual, quantize_128x128, row_tiles
from mt_ops.fp8_swiglu import swiglu_backward_quantize_1x128, swiglu_quantize_1x128

# name: (experts, top-k, hidden D, expert hidden F)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "deepseek-v2-lite": (64, 6, 2048, 1408)}


def bench_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def alternating_ms(*fns, rounds: int = 3) -> list[float]:
    """Each of ``fns`` timed by :func:`bench_ms` in ``rounds`` alternating rounds, the median
    per function: a ratio of two then compares runs made under the same GPU clocks and
    temperature, which drift over the seconds between two single measurements. The H200
    runs these steps at its 700 W power cap (nvidia-smi: SM clocks 1200-1740 MHz against
    1980 idle, throttle reason "SW power cap"), and a BF16 step measured 9.13 and 9.39 ms
    in two runs of one session."""
    times = [[bench_ms(fn) for fn in fns] for _ in range(rounds)]
    return [sorted(column)[rounds // 2] for column in zip(*times, strict=True)]


def copy_bandwidth() -> float:
    src = torch.randn(1 << 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / ms / 1e6  # GB/s, read + write


def quantization(copy_gbs: float) -> None:
    x = torch.randn(65536, 4096, device="cuda", dtype=torch.bfloat16)
    n = x.numel()
    scales = n // 128 * 4
    rows = bench_ms(lambda: quantize_1x128(x))
    dual = bench_ms(lambda: quantize_1x128_dual(x))

    def dual_triton_ms():
        return bench_ms(lambda: quantize_1x128_dual(x))

    dual_triton = _with_config(fp8_quant.QUANT_CONFIG, {"dual_gluon": False}, dual_triton_ms)
    for name, ms, nbytes in (
        ("quant 1x128 rows  bf16 [65536,4096]", rows, 2 * n + n + scales),
        ("quant 1x128 dual  bf16 [65536,4096]", dual, 2 * n + 2 * n + 2 * scales),
        ("quant 1x128 dual  bf16 [65536,4096] Triton", dual_triton, 4 * n + 2 * scales),
    ):
        gbs = nbytes / ms / 1e6
        print(f"{name}: {ms * 1e3:8.1f} us {gbs:7.0f} GB/s = {gbs / copy_gbs:.2f}x copy")
    w = torch.randn(128, 1536, 2048, device="cuda", dtype=torch.float32)  # experts' weights
    ms = bench_ms(lambda: quantize_128x128(w, transpose=True))
    gbs = (4 * w.numel() + 2 * w.numel()) / ms / 1e6
    print(f"quant 128x128+T fp32 [128,1536,2048]: {ms * 1e3:8.1f} us {gbs:7.0f} GB/s = "
          f"{gbs / copy_gbs:.2f}x copy")  # fmt: skip
    # Fused SwiGLU + quantization on the Qwen3 expert hidden size, 16k tokens x top-8.
    rows_r, hidden = 131072, 768
    tiles = row_tiles(counts_for(rows_r, 128, False), rows_r)
    gate, up, dh = (torch.randn(rows_r, hidden, device="cuda", dtype=torch.bfloat16)
                    for _ in range(3))  # fmt: skip
    m = rows_r * hidden
    fused_f = bench_ms(lambda: swiglu_quantize_1x128(gate, up, tiles=tiles))
    unfused_f = bench_ms(lambda: quantize_1x128_dual(swiglu(gate, up), tiles=tiles))
    fused_b = _with_fused_swiglu_bwd(
        lambda: bench_ms(lambda: swiglu_backward_quantize_1x128(dh, gate, up, tiles=tiles))
    )
    g_, u_ = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    h_ = swiglu(g_, u_)  # the graph is built once: the timing holds only the backward

    def unfused_bwd():
        dgate, dup = torch.autograd.grad(h_, (g_, u_), dh, retain_graph=True)
        quantize_1x128_dual(dgate, tiles=tiles)
        quantize_1x128_dual(dup, tiles=tiles)

    unfused_b = bench_ms(unfused_bwd)
    for name, fused, unfused, nbytes in (
        ("swiglu+quant fwd [131072,768]", fused_f, unfused_f, 4 * m + 2 * m),
        ("swiglu+quant bwd [131072,768]", fused_b, unfused_b, 6 * m + 4 * m),
    ):
        gbs = nbytes / fused / 1e6
        print(f"{name}: fused {fused * 1e3:7.1f} us ({gbs:5.0f} GB/s = {gbs / copy_gbs:.2f}x "
              f"copy) | unfused {unfused * 1e3:7.1f} us = {unfused / fused:.2f}x")  # fmt: skip


def _with_config(config: dict, values: dict, run):
    """Runs ``run()`` with ``config`` updated by ``values``; restores it afterwards."""
    saved = {key: config[key] for key in values}
    config.update(values)
    try:
        return run()
    finally:
        config.update(saved)


def _with_fused_swiglu_bwd(run):
    """Runs ``run()`` with the one-pass SwiGLU-backward kernel (``bwd_fused`` True).

    The module default (False) sends ``swiglu_backward_quantize_1x128`` down the unfused
    path, which ignores ``bwd_warps`` and is not the kernel a "fused" label names.
    """
    return _with_config(fp8_swiglu.SWIGLU_QUANT_CONFIG, {"bwd_fused": True}, run)


def _best(label, candidates, run, config):
    """Times ``run()`` under each candidate setting of ``config``; keeps the fastest."""
    timings = []
    for cand in candidates:
        config.update(cand)
        try:
            ms = bench_ms(run)
        except Exception as err:  # noqa: BLE001 - a config may not compile; report it
            print(f"sweep {label} {cand}: failed {type(err).__name__}: {err}"[:300])
            continue
        timings.append((ms, cand))
        print(f"sweep {label} {cand}: {ms * 1e3:8.1f} us")
    ms, cand = min(timings, key=lambda t: t[0])
    config.update(cand)
    return ms


def dual_store_variants() -> None:
    """Times the dual quantizers with each transposed-store pattern and checks their bytes.

    Restores the module defaults afterwards, so the sections that follow measure those.
    """
    qc, sc = fp8_quant.QUANT_CONFIG, fp8_swiglu.SWIGLU_QUANT_CONFIG
    saved = dict(qc), dict(sc)
    qc["dual_gluon"] = False  # the store patterns are the Triton kernel's
    x = torch.randn(65536, 4096, device="cuda", dtype=torch.bfloat16)
    small = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16) * 10
    counts = counts_for(8192, 16, True)
    tiles_small = row_tiles(counts, 8192)
    ref_rows, ref_cols = fp8_quant.quantize_1x128_dual_reference(small, tiles=tiles_small)
    gate, up = (torch.randn(131072, 768, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    tiles = row_tiles(counts_for(131072, 128, False), 131072)
    for trans in (False, True):
        for warps in (4, 8):
            qc.update(dual_trans_store=trans, dual_warps=warps)
            rows, cols = quantize_1x128_dual(small, tiles=tiles_small)
            exact = torch.equal(rows.data.view(torch.uint8), ref_rows.data.view(torch.uint8))
            exact &= torch.equal(cols.data.view(torch.uint8), ref_cols.data.view(torch.uint8))
            exact &= torch.equal(cols.scale, ref_cols.scale)
            dual = bench_ms(lambda: quantize_1x128_dual(x))
            fwd = bench_ms(lambda: swiglu_quantize_1x128(gate, up, tiles=tiles))
            bwd = bench_ms(lambda: swiglu_backward_quantize_1x128(gate, gate, up, tiles=tiles))
            print(f"dual store trans={trans} warps={warps}: bit-exact {exact} | dual "
                  f"[65536,4096] {dual * 1e3:6.1f} us | swiglu+quant fwd {fwd * 1e3:6.1f} us, "
                  f"bwd {bwd * 1e3:6.1f} us (swiglu warps {sc})")  # fmt: skip
    qc.update(saved[0])
    sc.update(saved[1])


def sweep() -> None:
    """Times kernel settings on the bench's shapes and keeps the fastest of each.

    Results set the defaults beside ``QUANT_CONFIG``, ``SWIGLU_QUANT_CONFIG``,
    ``GEMM_CONFIG``, ``TMA`` and ``WGRAD_TMA_CONFIG`` (``WGRAD_CONFIG`` without TMA).
    """
    x = torch.randn(65536, 4096, device="cuda", dtype=torch.bfloat16)
    qc = fp8_quant.QUANT_CONFIG
    rows_cands = ((32, 1, 4), (16, 8, 4), (8, 8, 4), (16, 4, 4), (32, 8, 8), (8, 16, 8))
    _best("quant rows", [{"rows_block_m": bm, "rows_col_tiles": ct, "rows_warps": w}
                         for bm, ct, w in rows_cands],
          lambda: quantize_1x128(x), qc)  # fmt: skip
    _with_config(qc, {"dual_gluon": False}, lambda: _best(  # the Triton kernel's setting
        "quant dual", [{"dual_warps": w} for w in (4, 8)], lambda: quantize_1x128_dual(x), qc
    ))  # fmt: skip
    del x
    num_experts, topk, dim, hidden = SHAPES["qwen3-30b-a3b"]
    rows = 16384 * topk
    counts = counts_for(rows, num_experts, False)
    tiles = row_tiles(counts, rows)
    gate, up = (torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sc = fp8_swiglu.SWIGLU_QUANT_CONFIG
    _best("swiglu quant fwd", [{"fwd_warps": w} for w in (4, 8)],
          lambda: swiglu_quantize_1x128(gate, up, tiles=tiles), sc)  # fmt: skip
    _with_fused_swiglu_bwd(lambda: _best(
        "swiglu quant bwd", [{"bwd_warps": w} for w in (4, 8, 16)],
        lambda: swiglu_backward_quantize_1x128(gate, gate, up, tiles=tiles), sc,
    ))  # fmt: skip
    x = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(num_experts, hidden, dim, device="cuda") * dim**-0.5
    xq, xqt = quantize_1x128_dual(x, tiles=tiles)
    (wq, _) = quantize_128x128(w)
    flops = 2 * rows * dim * hidden
    tma = fp8_gemm.TMA
    _best("gemm fprop loads", [{"enabled": e, "persistent": p} for e, p in
                               ((False, False), (True, False), (True, True))],
          lambda: fp8_grouped_gemm(xq, wq, tiles, backend="triton"), tma)  # fmt: skip
    gemm_cands = [{"N_FASTEST": nf, "num_stages": s, "num_warps": 8}
                  for nf, s in ((False, 4), (True, 4), (True, 3), (True, 5))]  # fmt: skip
    ms = _best("gemm fprop", gemm_cands, lambda: fp8_grouped_gemm(xq, wq, tiles, backend="triton"),
               fp8_gemm.GEMM_CONFIG)  # fmt: skip
    print(f"  fprop best {flops / ms / 1e9:.0f} TFLOP/s")
    _, dyqt = quantize_1x128_dual(gate, tiles=tiles)
    ref_w = fp8_grouped_wgrad_reference(dyqt, xqt, tiles)
    wgrad_cands = ((128, 64, 4, 4), (64, 128, 4, 4), (64, 128, 4, 8), (128, 128, 3, 8),
                   (64, 256, 3, 8), (128, 64, 5, 4))  # fmt: skip
    wgrad_config = fp8_gemm.WGRAD_TMA_CONFIG if tma["enabled"] else fp8_gemm.WGRAD_CONFIG
    ms = _best("wgrad", [{"BLOCK_M": bm, "BLOCK_N": bn, "num_stages": s, "num_warps": nw}
                         for bm, bn, s, nw in wgrad_cands],
               lambda: fp8_grouped_wgrad(dyqt, xqt, tiles, backend="triton"),
               wgrad_config)  # fmt: skip
    got = fp8_grouped_wgrad(dyqt, xqt, tiles, backend="triton")
    err = float((got - ref_w).norm() / ref_w.norm())
    print(f"  wgrad best {flops / ms / 1e9:.0f} TFLOP/s, err vs emulation {err:.1e}")
    print("chosen:", fp8_quant.QUANT_CONFIG, sc, fp8_gemm.GEMM_CONFIG, tma, wgrad_config)


def counts_for(num_rows: int, num_experts: int, skewed: bool) -> torch.Tensor:
    if not skewed:
        base = torch.full((num_experts,), num_rows // num_experts)
        base[: num_rows - int(base.sum())] += 1
        return base.cuda()
    # Zipf-like load: expert e gets weight 1/(e+1)^0.8, a few experts get zero rows.
    weights = 1.0 / torch.arange(1, num_experts + 1).double() ** 0.8
    weights[-3:] = 0
    counts = (weights / weights.sum() * num_rows).floor().long()
    counts[0] += num_rows - int(counts.sum())
    return counts[torch.randperm(num_experts)].cuda()


def dense_gemms() -> None:
    m, k, n = 16384, 4096, 4096
    flops = 2 * m * k * n
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    bf16 = bench_ms(lambda: a @ b.T)
    counts = torch.tensor([m], device="cuda")
    tiles = row_tiles(counts, m)
    aq = quantize_1x128(a)
    (bq, _) = quantize_128x128(b.float().unsqueeze(0).contiguous())
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    ones_a = torch.ones(m, 1, device="cuda")
    ones_b = torch.ones(1, n, device="cuda")
    rowwise = bench_ms(lambda: torch._scaled_mm(a8, b8.T, ones_a, ones_b, out_dtype=torch.bfloat16))
    line = f"dense {m}x{k}x{n}: bf16 {flops / bf16 / 1e9:6.0f} TFLOP/s"
    line += f" | torch rowwise fp8 {flops / rowwise / 1e9:6.0f}"
    for backend in ("torch", "triton"):
        try:
            ms = bench_ms(lambda b=backend: fp8_grouped_gemm(aq, bq, tiles, backend=b))
            line += f" | {backend} blockwise fp8 {flops / ms / 1e9:6.0f} ({bf16 / ms:.2f}x bf16)"
        except Exception as err:  # noqa: BLE001 - report and continue
            line += f" | {backend} failed: {type(err).__name__}: {err}"[:200]
    print(line)
    # Weight gradient dW = dyᵀ a (the token dim contracted), both operands 1×128 token tiles.
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    (_, aqt), (_, dyqt) = quantize_1x128_dual(a, tiles=tiles), quantize_1x128_dual(dy, tiles=tiles)
    bf16_w = bench_ms(lambda: dy.T @ a)
    line = f"dense wgrad {n}x{k} over {m} tokens: bf16 {flops / bf16_w / 1e9:6.0f} TFLOP/s"
    # "torch" takes the Hopper kernel where it runs; "cuBLAS" forces cuBLAS (the tiles side
    # by side) by switching the Hopper kernels off.
    for label, backend, hopper in (("torch", "torch", True), ("cuBLAS", "torch", False),
                                   ("triton", "triton", True)):  # fmt: skip
        for out_dtype in (torch.float32, torch.bfloat16):
            def wgrad_ms(b=backend, o=out_dtype):
                return bench_ms(lambda: fp8_grouped_wgrad(dyqt, aqt, tiles, out_dtype=o, backend=b))

            ms = _with_config(fp8_gemm.HOPPER, {"enabled": hopper}, wgrad_ms)
            line += f" | {label} fp8 {str(out_dtype)[6:]} {flops / ms / 1e9:6.0f}"
            line += f" ({bf16_w / ms:.2f}x)"
    print(line)


def grouped_gemms(name: str, num_tokens: int, skewed: bool) -> None:
    num_experts, topk, dim, hidden = SHAPES[name]
    rows = num_tokens * topk
    counts = counts_for(rows, num_experts, skewed)
    tiles = row_tiles(counts, rows)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(num_experts, hidden, dim, device="cuda", dtype=torch.bfloat16) * dim**-0.5
    flops = 2 * rows * dim * hidden
    bf16 = bench_ms(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs))
    xq, xqt = quantize_1x128_dual(x, tiles=tiles)
    (wq, _) = quantize_128x128(w.float().contiguous())
    ours = bench_ms(lambda: fp8_grouped_gemm(xq, wq, tiles, backend="triton"))
    line = f"{name:17s} {'skewed' if skewed else 'balanced':8s} fprop [{rows}x{dim}]->{hidden}: "
    line += f"bf16 {flops / bf16 / 1e9:5.0f} TFLOP/s | ours fp8 {flops / ours / 1e9:5.0f} "
    line += f"({bf16 / ours:.2f}x)"
    try:
        x8 = x.to(torch.float8_e4m3fn)
        w8 = w.to(torch.float8_e4m3fn)
        sa = torch.ones(rows, device="cuda")
        sb = torch.ones(num_experts, hidden, device="cuda")
        rowwise = bench_ms(
            lambda: torch._scaled_grouped_mm(
                x8, w8.transpose(-2, -1), sa, sb, offs=offs, out_dtype=torch.bfloat16
            )
        )
        line += f" | torch rowwise fp8 {flops / rowwise / 1e9:5.0f}"
    except Exception as err:  # noqa: BLE001
        line += f" | torch rowwise failed: {type(err).__name__}"
    dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    _, dyqt = quantize_1x128_dual(dy, tiles=tiles)
    bf16_w = bench_ms(lambda: torch._grouped_mm(dy.T, x, offs=offs))
    ours_w = bench_ms(lambda: fp8_grouped_wgrad(dyqt, xqt, tiles, backend="triton"))
    line += f" || wgrad bf16 {flops / bf16_w / 1e9:5.0f} | ours fp8 {flops / ours_w / 1e9:5.0f}"
    line += f" ({bf16_w / ours_w:.2f}x)"
    # dgrad of gate + up: dx = dgate Wg + dup Wu, BF16 two GEMMs + add, and one GEMM over
    # the concatenated K, vs one FP8 sum GEMM.
    w2 = torch.randn_like(w)
    dy2 = torch.randn_like(dy)
    bf16_d = bench_ms(
        lambda: torch._grouped_mm(dy, w, offs=offs) + torch._grouped_mm(dy2, w2, offs=offs)
    )
    dyq, _ = quantize_1x128_dual(dy, tiles=tiles)
    dy2q, _ = quantize_1x128_dual(dy2, tiles=tiles)
    (_, wqt) = quantize_128x128(w.float().contiguous(), transpose=True)
    (_, w2qt) = quantize_128x128(w2.float().contiguous(), transpose=True)
    ours_d = bench_ms(lambda: fp8_grouped_gemm_sum(dyq, wqt, dy2q, w2qt, tiles, backend="triton"))
    # The fairer BF16 baseline: one GEMM over the concatenated K (gate and up stacked, as a
    # fused gate_up weight gives), no add; the concatenation is made outside the timing.
    dy_cat, w_cat = torch.cat([dy, dy2], dim=1), torch.cat([w, w2], dim=1)
    bf16_d1 = bench_ms(lambda: torch._grouped_mm(dy_cat, w_cat, offs=offs))
    line += f" || dgrad gate+up bf16 2 GEMMs + add {2 * flops / bf16_d / 1e9:5.0f}, one GEMM "
    line += f"over 2K {2 * flops / bf16_d1 / 1e9:5.0f} | ours fp8 sum "
    line += f"{2 * flops / ours_d / 1e9:5.0f} ({bf16_d / ours_d:.2f}x, {bf16_d1 / ours_d:.2f}x)"
    print(line)


PROFILE = False
PROFILE_STEPS = 10


def _kernels_per_call(run) -> list[tuple[str, float]]:
    """``run``'s kernels in launch order with their mean durations over PROFILE_STEPS
    back-to-back runs (traced after warm-up runs; trace_summary.per_call)."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILE_STEPS):
            run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return per_call(json.loads(path.read_text()), PROFILE_STEPS)


def _host_ms_per_call(run) -> float:
    """Host time to issue one ``run`` (mean over PROFILE_STEPS issued back to back, without
    waiting for the GPU): near the GPU time of a step, the launches leave the GPU idle."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(PROFILE_STEPS):
        run()
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    return issued * 1e3 / PROFILE_STEPS
SECTIONS = ("sweep", "variants", "quant", "dense", "grouped", "mlp", "block")


def _experts(name: str, fp8: bool, cache=None, master=False) -> list[torch.nn.Module]:
    """gate, up, down of one MoE layer's experts on CUDA (BF16 parameters unless master)."""
    num_experts, _, dim, hidden = SHAPES[name]
    torch.manual_seed(0)
    projs = []
    for d_in, d_out in ((dim, hidden), (dim, hidden), (hidden, dim)):
        m = GroupedLinear(num_experts, d_in, d_out).cuda()
        torch.nn.init.normal_(m.weight, std=d_in**-0.5)
        if fp8:
            m = FP8GroupedLinear.from_grouped_linear(m, weight_cache=cache, backend="triton")
        if not master:
            m = m.bfloat16()
        projs.append(m)
    return projs


def expert_block(name: str, num_tokens: int, skewed: bool) -> None:
    """permute → expert MLP → unpermute, forward + backward: BF16 modules, FP8 with the
    MLP fused (permute and unpermute separate), and the FP8 block with both fused."""
    num_experts, topk, dim, _ = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.zeros(num_experts, device="cuda")
    # Skewed: counts_for's Zipf-like weights, sampled per token (Gumbel top-k). Top-k draws
    # K distinct experts, which flattens the load: the busiest expert gets ~10x the mean
    # rows (Qwen3 shapes; ~7x DeepSeek-V2-Lite), against ~15x (~9x) in counts_for, so the
    # block's skewed case is milder than the MLP's and the GEMMs'.
    if skewed:
        logits = -0.8 * torch.arange(1, num_experts + 1, device="cuda").float().log()
        logits[-3:] = float("-inf")
    gumbel = -torch.empty(num_tokens, num_experts, device="cuda").exponential_(generator=gen).log()
    plan = plan_dispatch((logits + gumbel).topk(topk, dim=-1).indices, num_experts)
    x = torch.randn(num_tokens, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weights = torch.rand(num_tokens, topk, device="cuda", requires_grad=True)
    grad = torch.randn(num_tokens, dim, device="cuda", dtype=torch.bfloat16)
    counts = plan.tokens_per_expert_E

    bf16, fp8 = _experts(name, False), _experts(name, True, FP8WeightCache())

    def run(block):
        block().backward(grad)
        x.grad = weights.grad = None
        for proj in (*bf16, *fp8):  # else each step adds its weight gradients to the last
            proj.weight.grad = None

    def modules():
        gate, up, down = bf16
        rows = permute(x, plan)
        return unpermute(down(swiglu(gate(rows, counts), up(rows, counts)), counts), plan, weights)

    def mlp_fused():
        return unpermute(fp8_swiglu_experts(permute(x, plan), counts, *fp8), plan, weights)

    ms = [bench_ms(lambda fn=fn: run(fn)) for fn in
          (modules, mlp_fused, lambda: fp8_moe_swiglu_experts(x, plan, weights, *fp8))]  # fmt: skip
    print(
        f"{name:17s} {'skewed' if skewed else 'balanced':8s} expert block (permute, MLP, "
        f"unpermute) fwd+bwd T={num_tokens}: bf16 {ms[0]:6.2f} ms | fp8, MLP fused {ms[1]:6.2f} "
        f"ms = {ms[0] / ms[1]:.2f}x | fp8, block fused {ms[2]:6.2f} ms = {ms[0] / ms[2]:.2f}x bf16"
    )


def expert_mlp(name: str, num_tokens: int, skewed: bool) -> None:
    num_experts, topk, dim, hidden = SHAPES[name]
    rows = num_tokens * topk
    counts = counts_for(rows, num_experts, skewed)
    flops = 3 * 3 * 2 * rows * dim * hidden  # 3 GEMMs, each fwd + dgrad + wgrad

    x = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16)

    def step(projs):
        gate, up, down = projs
        out = down(swiglu(gate(x, counts), up(x, counts)), counts)
        out.backward(grad)
        x.grad = None  # in a model dx flows on to the permute; nothing accumulates it
        for proj in projs:
            proj.weight.grad = None

    def fused_step(projs):
        gate, up, down = projs
        fp8_swiglu_experts(x, counts, gate, up, down).backward(grad)
        x.grad = None
        for proj in projs:
            proj.weight.grad = None

    # Parameters in BF16 on both sides, as FSDP2 mixed precision presents the unsharded
    # weights to the experts (gradients in BF16 too); "fp32 master" keeps FP32 parameters
    # in the FP8 modules (one-process training), whose gradients are FP32.
    bf16 = _experts(name, False)
    cache = FP8WeightCache()
    fp8 = _experts(name, True, cache)
    fp8_master = _experts(name, True, FP8WeightCache(), master=True)
    # The headline ratio: BF16 and the fused FP8 step, alternating (alternating_ms).
    ms_bf16, ms_fused = alternating_ms(lambda: step(bf16), lambda: fused_step(fp8))
    ms_fp8 = bench_ms(lambda: step(fp8))  # weights quantized once (warm cache)
    ms_master = bench_ms(lambda: fused_step(fp8_master))
    cold = bench_ms(lambda: (cache.invalidate(), fused_step(fp8)))
    config = fp8_swiglu.SWIGLU_QUANT_CONFIG
    ms_other = _with_config(  # the other SwiGLU-backward choice
        config, {"bwd_fused": not config["bwd_fused"]}, lambda: bench_ms(lambda: fused_step(fp8))
    )
    if not skewed and PROFILE:
        for label, fn, projs in (("fp8 fused", fused_step, fp8), ("bf16", step, bf16)):
            calls = _kernels_per_call(lambda fn=fn, projs=projs: fn(projs))
            host = _host_ms_per_call(lambda fn=fn, projs=projs: fn(projs))
            print(f"{name} balanced {label} MLP step, kernels per call (us, mean of "
                  f"{PROFILE_STEPS} back-to-back steps), {sum(t for _, t in calls):.0f} us in "
                  f"all, host issue time {host * 1e3:.0f} us: "
                  + " ".join(f"{n[:24]}={t:.0f}" for n, t in calls))  # fmt: skip
    print(
        f"{name:17s} {'skewed' if skewed else 'balanced':8s} expert MLP fwd+bwd T={num_tokens}: "
        f"bf16 {ms_bf16:6.2f} ms ({flops / ms_bf16 / 1e9:4.0f} TFLOP/s) | fp8 modules "
        f"{ms_fp8:6.2f} ms = {ms_bf16 / ms_fp8:.2f}x | fp8 fused {ms_fused:6.2f} ms "
        f"({flops / ms_fused / 1e9:4.0f}) = {ms_bf16 / ms_fused:.2f}x bf16 | fused, fp32 master "
        f"{ms_master:6.2f} ms = {ms_bf16 / ms_master:.2f}x | fused incl. weight "
        f"quantization {cold:6.2f} ms = {ms_bf16 / cold:.2f}x | with the SwiGLU backward "
        f"{'unfused' if config['bwd_fused'] else 'fused'} {ms_other:6.2f} ms = "
        f"{ms_bf16 / ms_other:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokens",
        type=int,
        default=16384,
        help="tokens of the grouped, mlp and block sections (the others use fixed shapes)",
    )
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of: {','.join(SECTIONS)}",
    )
    parser.add_argument("--skip-sweep", action="store_true", help="same as leaving out 'sweep'")
    parser.add_argument(
        "--profile", action="store_true",
        help="mlp section: print each kernel of the balanced FP8 (fused) and BF16 steps with "
        f"its mean time over {PROFILE_STEPS} back-to-back steps, and the host time to issue "
        "a step",
    )  # fmt: skip
    args = parser.parse_args()
    if unknown := sorted(set(args.sections.split(",")) - set(SECTIONS)):
        parser.error(f"--sections: unknown {unknown}; pick from {','.join(SECTIONS)}")
    global PROFILE
    PROFILE = args.profile
    chosen = set(args.sections.split(",")) - ({"sweep"} if args.skip_sweep else set())
    print(torch.cuda.get_device_name(), torch.__version__)
    copy_gbs = copy_bandwidth()
    print(f"copy bandwidth (read + write): {copy_gbs:.0f} GB/s")
    for recipe in fp8_gemm.SCALED_MM_RECIPES:
        print(f"cuBLAS blockwise _scaled_mm {recipe} works:", fp8_gemm._scaled_mm_works(0, recipe))
    print("probe errors:", fp8_gemm.SCALED_MM_PROBE_ERRORS)
    named = [
        ("sweep", sweep),
        ("variants", dual_store_variants),
        ("quant", lambda: quantization(copy_gbs)),
        ("dense", dense_gemms),
    ]
    for key, fn in (("grouped", grouped_gemms), ("mlp", expert_mlp), ("block", expert_block)):
        for name in SHAPES:
            for skewed in (False, True):
                named.append(
                    (key, lambda fn=fn, name=name, skewed=skewed: fn(name, args.tokens, skewed))
                )
    sections = [fn for key, fn in named if key in chosen]
    for section in sections:
        try:
            section()
        except Exception as err:  # noqa: BLE001 - report and go on to the next section
            print(f"FAILED: {type(err).__name__}: {err}"[:400])


if __name__ == "__main__":
    main()
