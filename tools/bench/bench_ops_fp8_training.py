"""FP8 vs BF16 training of the debug Qwen3-MoE over 200 steps, with an FP32 control (cross-package).

Builds the ``debug`` Qwen3-MoE (mt-models) once per variant from the same seed and trains
each on the same batches with AdamW (warm-up, cosine decay, clipping, as the ``debug``
recipe does):

- ``bf16``: BF16 autocast, FP32 master weights (the baseline);
- ``fp8``: the same, with ``mt_ops.convert_to_fp8`` (attention projections and experts in
  block-scaled FP8; head, router, embedding and norms BF16/FP32) and a weight cache
  invalidated after every optimizer step;
- ``fp32``: no autocast: the control. Its distance from BF16 is what a change of numerics
  alone does to this run (the noise floor of the comparison).

The loss curves are compared by their 10-step moving averages: the largest relative gap
to BF16 once the window is full, and the gap at the end. The target (issue #4) is within
1%; the exit code is 1 when FP8 misses it.

The peak LR is the ``debug`` recipe's 1e-3 (it was 3e-3): at 3e-3 this model trains through
gradient-norm spikes (the recipe's FP32 run on CPU logs norms up to 61 before clipping in
its first 25 steps), and any change of numerics sends the run down another path, so the
comparison measures that path noise, not FP8. Measured on the H200 (200 steps of 16×256,
corpus): at 3e-3 the FP32 control is itself 2.1% from BF16, and FP8's gap has either sign
with the seed (−2.7% seed 0, +2.5% seed 1; −3.5% on the synthetic stream below); at 1e-3
FP8 stays within 0.27% of BF16 while the FP32 control is 0.85% away. The CPU emulation
behaves the same way (FP8 against FP32, 120 steps of 8×256: −1.1% at 3e-3, −0.7% at
1e-3; at 3e-3 a 1e-3 perturbation of the initial weights alone moves the FP32 curve by
0.6%, and BF16 rounding of the same GEMMs' operands by 0.7%), while each FP8 GEMM is
within ``calc_diff`` 7e-4 of FP32 on the run's own activations and gradients.

Data: ``--data corpus`` (default) is mt-data's embedded corpus (the ``debug`` recipe's);
``--data lcg`` is the synthetic stream this benchmark used first (``t[i+1] = (a·t[i] + b)
mod V``; in-context modular arithmetic that this model barely learns in 200 steps, which
made the first version of this benchmark report a 4.2% gap: path noise, as above).

``--compare RUN_A RUN_B`` instead compares two ``mt-train pretrain`` run directories by
their ``metrics.jsonl`` (e.g. ``precision.fp8=true`` against the default).

Run (repository root): ``PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3``
``tools/bench/bench_ops_fp8_training.py``. CPU works through the exact FP8 emulation, but
BF16 autocast on CPU is slow: try ``--variants fp32,fp8`` (FP32 the baseline).
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from mt_models import Qwen3MoeForCausalLM
from mt_models.qwen3_moe import debug
from mt_ops.fp8_linear import FP8GroupedLinear, FP8Linear, FP8WeightCache, convert_to_fp8

WINDOW = 10  # moving-average window of the comparison (steps)
TARGET = 0.01  # relative gap to BF16 (issue #4)


def corpus_batches(num_steps, batch, seq, vocab, device, seed):
    """Batches of mt-data's embedded corpus, as the ``debug`` recipe reads them."""
    from mt_data import TokenDataset, default_corpus_dir

    dataset = TokenDataset(default_corpus_dir(), seq, seed=seed)
    assert (dataset.vocab_size or 0) <= vocab, f"{dataset.vocab_size=}, {vocab=}"
    for _ in range(num_steps):
        tokens = torch.from_numpy(dataset.take(batch)).long().to(device)
        yield tokens[:, :-1], tokens[:, 1:]


def lcg_batches(num_steps, batch, seq, vocab, device, seed):
    """The synthetic stream: each row follows ``t[i+1] = (a·t[i] + b) mod V``."""
    gen = torch.Generator().manual_seed(1234 + seed)
    for _ in range(num_steps):
        start = torch.randint(0, vocab, (batch, 1), generator=gen)
        mult = torch.randint(1, 8, (batch, 1), generator=gen) * 2 + 1
        add = torch.randint(0, vocab, (batch, 1), generator=gen)
        tokens = [start]
        for _ in range(seq):
            tokens.append((tokens[-1] * mult + add) % vocab)
        seq_BS = torch.cat(tokens, dim=1).to(device)
        yield seq_BS[:, :-1], seq_BS[:, 1:]


def lr_at(step, args):
    """Linear warm-up to ``args.lr``, then cosine decay to a tenth (the recipe's schedule)."""
    if step <= args.warmup:
        return args.lr * step / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def check_kernels(device) -> None:
    """Prints how far this device's FP8 linear is from the exact emulation (fwd, dgrad,
    wgrad; expected ~1e-4 from Hopper's FP8 accumulation): a broken kernel would otherwise
    show up only as a loss gap."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1000, 256, device=device, generator=gen).bfloat16()
    dy = torch.randn(1000, 384, device=device, generator=gen).bfloat16()
    weight = torch.randn(384, 256, device=device, generator=gen) * 0.05
    results = []
    for backend in (None, "emulation"):
        linear = FP8Linear(256, 384, bias=False, backend=backend).to(device)
        with torch.no_grad():
            linear.weight.copy_(weight)
        x_in = x.clone().requires_grad_(True)
        y = linear(x_in)
        y.backward(dy)
        results.append((y.detach().float(), x_in.grad.float(), linear.weight.grad))
    errors = [float((a - b).norm() / b.norm()) for a, b in zip(*results, strict=True)]
    fprop, dgrad, wgrad = errors
    print(
        f"FP8 linear vs exact emulation (L2-relative): fprop {fprop:.1e}, dgrad {dgrad:.1e}, "
        f"wgrad {wgrad:.1e}",
        flush=True,
    )


def train(variant: str, args, device) -> list[float]:
    """Trains one variant; returns its per-step cross-entropy."""
    config = debug()
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    model.to_empty(device=device)
    model.init_weights(seed=args.seed)
    cache = None
    if variant == "fp8":
        cache = FP8WeightCache()
        convert_to_fp8(model, weight_cache=cache)
        converted = sum(isinstance(m, FP8Linear | FP8GroupedLinear) for m in model.modules())
        print(f"fp8: converted {converted} modules", flush=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    make_batches = corpus_batches if args.data == "corpus" else lcg_batches
    stream = make_batches(args.steps, args.batch, args.seq, config.vocab_size, device, args.seed)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=variant != "fp32")
    losses, start = [], time.perf_counter()
    for step, (input_ids, labels) in enumerate(stream, start=1):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        with autocast:
            out = model.loss(input_ids, labels)
            loss = out.ce_sum / out.num_tokens + out.aux_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cache is not None:
            cache.invalidate()
        losses.append(float(out.ce_sum.detach() / out.num_tokens))
    print(f"{variant}: {args.steps} steps in {time.perf_counter() - start:.1f} s", flush=True)
    return losses


def moving_average(xs: list[float]) -> list[float]:
    """Mean of each step's last ``WINDOW`` losses (fewer at the start)."""
    return [sum(xs[max(0, i - WINDOW + 1) : i + 1]) / min(i + 1, WINDOW) for i in range(len(xs))]


def gaps(other: list[float], base: list[float]) -> tuple[float, float]:
    """(largest, final) relative gap of the moving averages, once the window is full."""
    smooth_o, smooth_b = moving_average(other), moving_average(base)
    rel = [(o - b) / b for o, b in zip(smooth_o, smooth_b, strict=True)][WINDOW - 1 :]
    return max(rel, key=abs), rel[-1]


def report(curves: dict[str, list[float]], base: str = "bf16", judged: str = "fp8") -> bool:
    """Prints the curves every 20 steps and the gaps to ``base``; True if ``judged`` (the
    FP8 curve) is on target."""
    names = list(curves)
    steps = len(curves[base])
    print("step  " + "  ".join(f"{n:>8s}" for n in names))
    for i in sorted({*range(0, steps, 20), steps - 1}):
        print(f"{i + 1:4d}  " + "  ".join(f"{curves[n][i]:8.4f}" for n in names))
    ok = True
    for name in names:
        if name == base:
            continue
        worst, final = gaps(curves[name], curves[base])
        verdict = ""
        if name == judged:
            ok = abs(worst) <= TARGET
            verdict = f"  -> {'PASS' if ok else 'FAIL'} (target |gap| <= {TARGET:.0%})"
        print(
            f"{name} vs {base}: largest relative gap of the {WINDOW}-step means over steps "
            f"{WINDOW}..{steps}: {worst:+.2%}; at the end: {final:+.2%}{verdict}"
        )
    return ok


def read_run(run_dir: str) -> list[float]:
    """Per-step losses of an ``mt-train pretrain`` run directory (its metrics.jsonl)."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    # A resumed run rewrites steps; a skipped step's non-finite loss is written as null.
    by_step = {row["step"]: math.nan if row["loss"] is None else row["loss"] for row in rows}
    return [by_step[s] for s in sorted(by_step)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3, help="peak LR (see the docstring)")
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--data", choices=("corpus", "lcg"), default="corpus")
    parser.add_argument("--seed", type=int, default=0, help="initialization and data order")
    parser.add_argument(
        "--variants",
        default="bf16,fp8,fp32",
        help="comma-separated; the first is the baseline of the gaps",
    )
    parser.add_argument(
        "--compare",
        nargs=2,
        metavar=("RUN_A", "RUN_B"),
        help="compare two mt-train run directories (A against B) instead",
    )
    parser.add_argument("--json", help="write the loss curves to this file")
    args = parser.parse_args()
    if args.steps < WINDOW:
        parser.error(f"--steps ({args.steps}) must be >= {WINDOW}, the moving-average window")
    variants = args.variants.split(",")
    if unknown := sorted(set(variants) - {"bf16", "fp8", "fp32"}):
        parser.error(f"--variants: unknown {unknown}; pick from bf16, fp8, fp32")
    if not args.compare and ("fp8" not in variants or variants[0] == "fp8" or len(variants) < 2):
        parser.error(f"--variants ({args.variants}) must start with a baseline (bf16 or "
                     "fp32) and include fp8, the curve judged against it")
    if args.compare:
        run_a, run_b = (Path(d).name for d in args.compare)
        if run_a == run_b:  # same last name (a/run, b/run): one dict key would judge A vs A
            run_a, run_b = args.compare
        curves = {run_b: read_run(args.compare[1]), run_a: read_run(args.compare[0])}
        steps = min(map(len, curves.values()))
        curves = {name: losses[:steps] for name, losses in curves.items()}
        sys.exit(0 if report(curves, base=run_b, judged=run_a) else 1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device {device}, data {args.data}, seed {args.seed}, lr {args.lr}, {args.steps} steps "
          f"of {args.batch}x{args.seq}")  # fmt: skip
    if device.type == "cuda":
        check_kernels(device)
    curves = {variant: train(variant, args, device) for variant in variants}
    if args.json:
        Path(args.json).write_text(json.dumps(curves))
    sys.exit(0 if report(curves, base=variants[0]) else 1)


if __name__ == "__main__":
    main()
