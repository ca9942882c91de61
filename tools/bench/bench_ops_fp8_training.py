"""FP8 vs BF16 training of the debug Qwen3-MoE: loss curves over 200 steps (cross-package).

Builds the ``debug`` Qwen3-MoE twice from the same seed, converts one with
``mt_ops.convert_to_fp8`` (attention projections, dense MLPs and experts; the head stays
BF16), and trains both with AdamW on the same synthetic stream under bf16 autocast. The
stream is learnable (each sequence follows ``t[i+1] = (a·t[i] + b) mod V``), so the loss
falls from ~ln V. Prints both losses every 20 steps and the largest relative gap of the
10-step moving averages; the target is within 1%.

Run (repository root): ``PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3``
``tools/bench/bench_ops_fp8_training.py``. CPU works too, through the exact FP8
emulation, but slowly: pass ``--steps 20``.
"""

import argparse

import torch

from mt_models import Qwen3MoeForCausalLM
from mt_models.qwen3_moe import debug
from mt_ops.fp8_linear import FP8GroupedLinear, FP8Linear, FP8WeightCache, convert_to_fp8


def batches(num_steps, batch, seq, vocab, device):
    gen = torch.Generator().manual_seed(1234)
    for _ in range(num_steps):
        start = torch.randint(0, vocab, (batch, 1), generator=gen)
        mult = torch.randint(1, 8, (batch, 1), generator=gen) * 2 + 1
        add = torch.randint(0, vocab, (batch, 1), generator=gen)
        tokens = [start]
        for _ in range(seq):
            tokens.append((tokens[-1] * mult + add) % vocab)
        seq_BS = torch.cat(tokens, dim=1).to(device)
        yield seq_BS[:, :-1], seq_BS[:, 1:]


def train(fp8: bool, args, device) -> list[float]:
    config = debug()
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    cache = None
    if fp8:
        cache = FP8WeightCache()
        convert_to_fp8(model, weight_cache=cache)
        converted = sum(isinstance(m, FP8Linear | FP8GroupedLinear) for m in model.modules())
        print(f"fp8: converted {converted} modules")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses = []
    stream = batches(args.steps, args.batch, args.seq, config.vocab_size, device)
    for input_ids, labels in stream:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = model.loss(input_ids, labels)
            loss = out.ce_sum / out.num_tokens + out.aux_loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cache is not None:
            cache.invalidate()
        losses.append(float(out.ce_sum.detach() / out.num_tokens))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bf16 = train(False, args, device)
    fp8 = train(True, args, device)

    def smooth(xs):
        return [
            sum(xs[max(0, i - 9) : i + 1]) / len(xs[max(0, i - 9) : i + 1]) for i in range(len(xs))
        ]

    sb, sf = smooth(bf16), smooth(fp8)
    gaps = [abs(f - b) / b for f, b in zip(sf, sb, strict=True)]
    for i in range(0, args.steps, 20):
        print(f"step {i:4d}: bf16 {bf16[i]:.4f} fp8 {fp8[i]:.4f}")
    gap = max(gaps) * 100
    print(f"final (10-step mean): bf16 {sb[-1]:.4f} fp8 {sf[-1]:.4f}; max relative gap of "
          f"the 10-step means over {args.steps} steps: {gap:.2f}% (target <= 1%)")  # fmt: skip


if __name__ == "__main__":
    main()
