"""GPU self-check of the FP8 quantization kernels: bit-exactness and NaN-freedom per output.

For each kernel configuration and a dense and a grouped problem, quantizes x, dy (dual,
with expert tiles) and the stacked weight (with transpose) through the kernels and through
the references, and prints per output: bits equal (fraction), NaN count in kernel output.

Run: ``PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 tools/bench/bench_ops_fp8_check.py``
"""

import argparse

import torch

import mt_ops.fp8_quant as fp8_quant
from mt_ops.fp8_quant import (
    quantize_1x128_dual,
    quantize_1x128_dual_reference,
    quantize_128x128,
    quantize_128x128_reference,
    row_tiles,
)


def compare(name, got, ref):
    gb, rb = got.data.view(torch.uint8), ref.data.view(torch.uint8)
    same = float((gb == rb).float().mean()) if gb.numel() else 1.0
    nan = int(torch.isnan(got.data.float()).sum())
    sg, sr = fp8_quant.scale_to_float(got.scale), fp8_quant.scale_to_float(ref.scale)
    scale_same = float((sg == sr).float().mean()) if sg.numel() else 1.0
    bad = (gb != rb).nonzero()[:3].tolist()
    print(f"  {name:8s} bits equal {same:.6f} scales equal {scale_same:.6f} nan {nan} "
          f"first diffs {bad}")  # fmt: skip


def main() -> None:
    # No options: --help describes the run instead of starting it on the GPU.
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " ")).parse_args()
    # The Triton dual kernel at each warp count, then (on Hopper) the Gluon one.
    for dual_gluon, dual_warps in ((False, 4), (False, 8), (True, 4)):
        fp8_quant.QUANT_CONFIG.update(dual_gluon=dual_gluon, dual_warps=dual_warps)
        for counts, k_dim, n_dim in (([1024], 2048, 768), ([0, 300, 17, 0, 700, 1], 768, 2048)):
            print(f"dual_gluon={dual_gluon} dual_warps={dual_warps} counts={counts} K={k_dim} "
                  f"N={n_dim}")  # fmt: skip
            gen = torch.Generator().manual_seed(0)
            rows = sum(counts)
            x = torch.randn(rows, k_dim, generator=gen).cuda()
            w = (torch.randn(len(counts), n_dim, k_dim, generator=gen) / k_dim**0.5).cuda()
            dy = torch.randn(rows, n_dim, generator=gen).cuda()
            tiles = row_tiles(torch.tensor(counts).cuda(), rows)
            for name, t in (("x", x), ("dy", dy)):
                got_r, got_c = quantize_1x128_dual(t, tiles=tiles)
                ref_r, ref_c = quantize_1x128_dual_reference(t, tiles=tiles)
                compare(name + ".rows", got_r, ref_r)
                compare(name + ".cols", got_c, ref_c)
            got_w, got_wt = quantize_128x128(w, transpose=True)
            ref_w, ref_wt = quantize_128x128_reference(w, transpose=True)
            compare("w", got_w, ref_w)
            compare("w.T", got_wt, ref_wt)


if __name__ == "__main__":
    main()
