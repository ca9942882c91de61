"""Import and export of Hugging Face Hub checkpoint directories.

A directory holds ``config.json`` and safetensors weights, either one
``model.safetensors`` or shards listed in ``model.safetensors.index.json``. Canonical
names (``CausalLM.canonical_parameters``) are the Hub keys, one per expert; only GPT-OSS
differs on disk: its Hub files stack the experts, transposed to [E, in, out] with
``_bias`` suffixes (``mlp.experts.gate_up_proj`` [E, D, 2F], ``gate_up_proj_bias``
[E, 2F], ``down_proj`` [E, F, D], ``down_proj_bias`` [E, D]), or store the matrices as
MXFP4 ``_blocks``/``_scales`` (dequantized on import, ``mxfp4.py``).
"""

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from mt_models.base import CausalLM
from mt_models.hf_config import config_from_hf, config_to_hf, family_of_hf_config
from mt_models.mxfp4 import dequantize_mxfp4
from mt_models.registry import MODEL_FAMILIES

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# GPT-OSS Hub key of a stacked expert tensor: <layer>.mlp.experts.<proj>[_bias].
_STACKED = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)(?P<bias>_bias)?$"
)


def _read_safetensors(path: Path) -> Iterator[tuple[str, Tensor]]:
    """Yields (key, tensor) of every tensor in the directory's safetensors files."""
    index = path / INDEX_NAME
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / SINGLE_NAME).exists():
        files = [SINGLE_NAME]
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no safetensors weights in {path}; expected {SINGLE_NAME} or {INDEX_NAME}"
        )
    for name in files:
        with safe_open(path / name, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield key, f.get_tensor(key)


def _dequantize_mxfp4_pairs(tensors: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """Replaces ``X_blocks`` + ``X_scales`` [E, O, I/32, 16] by the Hub's ``X`` [E, I, O]."""
    out = {}
    for key, tensor in tensors.items():
        if key.endswith("_scales"):
            continue
        if key.endswith("_blocks"):
            base = key[: -len("_blocks")]
            scales = tensors.get(base + "_scales")
            if scales is None:
                raise ValueError(f"{key} has no matching {base}_scales in the checkpoint")
            out[base] = dequantize_mxfp4(tensor, scales, dtype).transpose(-2, -1)  # [E, I, O]
        else:
            out[key] = tensor
    return out


def hub_to_canonical(family: str, hub: dict[str, Tensor]) -> dict[str, Tensor]:
    """Maps Hub keys to canonical keys (GPT-OSS: unstack and transpose experts).

    Args:
        family: The family name.
        hub: Hub key → tensor (MXFP4 already dequantized).

    Returns:
        Canonical key → tensor.
    """
    if family != "gpt_oss":
        return dict(hub)
    out = {}
    for key, tensor in hub.items():
        match = _STACKED.match(key)
        if match is None:
            out[key] = tensor
            continue
        prefix, proj = match["prefix"], match["proj"]
        for expert_id in range(tensor.shape[0]):
            if match["bias"]:
                out[f"{prefix}.{expert_id}.{proj}.bias"] = tensor[expert_id]
            else:
                out[f"{prefix}.{expert_id}.{proj}.weight"] = tensor[expert_id].T  # [O, I]
    return out


def canonical_to_hub(family: str, canonical: dict[str, Tensor]) -> dict[str, Tensor]:
    """Maps canonical keys to Hub keys (GPT-OSS: stack and transpose experts).

    Args:
        family: The family name.
        canonical: Canonical key → tensor (every expert of every layer).

    Returns:
        Hub key → tensor.
    """
    if family != "gpt_oss":
        return dict(canonical)
    out, stacks = {}, {}
    pattern = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_up_proj|down_proj)\.(weight|bias)$")
    for key, tensor in canonical.items():
        match = pattern.match(key)
        if match is None:
            out[key] = tensor
            continue
        prefix, expert_id, proj, kind = match.groups()
        hub_key = f"{prefix}.{proj}" + ("_bias" if kind == "bias" else "")
        stacks.setdefault(hub_key, {})[int(expert_id)] = tensor if kind == "bias" else tensor.T
    for hub_key, experts in stacks.items():
        out[hub_key] = torch.stack([experts[e] for e in range(len(experts))])
    return out


def load_hf(
    path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> CausalLM:
    """Builds a model from a Hub checkpoint directory.

    Args:
        path: Directory with ``config.json`` and safetensors weights (sharded or not).
        dtype: Parameter dtype; None keeps the checkpoint's (its embedding's dtype).
        device: Where the parameters live.

    Returns:
        The model, every parameter set from the checkpoint.
    """
    path = Path(path)
    data = json.loads((path / "config.json").read_text())
    family = family_of_hf_config(data)
    config = config_from_hf(data)
    hub = dict(_read_safetensors(path))
    if dtype is None:
        embed = hub.get("model.embed_tokens.weight")
        dtype = embed.dtype if embed is not None else torch.float32
    canonical = hub_to_canonical(family, _dequantize_mxfp4_pairs(hub, dtype))
    with torch.device("meta"):
        model = MODEL_FAMILIES[family][1](config)
    model.to_empty(device=device)
    model.to(dtype)
    targets = model.canonical_parameters()
    if config.tie_word_embeddings:
        canonical.pop("lm_head.weight", None)
    missing = sorted(set(targets) - set(canonical))
    unexpected = sorted(set(canonical) - set(targets))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match its config.json: missing {missing[:5]} "
            f"({len(missing)} in all), unexpected {unexpected[:5]} ({len(unexpected)} in all)"
        )
    with torch.no_grad():
        for key, target in targets.items():
            source = canonical[key]
            if source.shape != target.shape:
                raise ValueError(
                    f"{key}: checkpoint shape {tuple(source.shape)} != model shape "
                    f"{tuple(target.shape)}; the weights do not fit config.json"
                )
            target.copy_(source)
    return model


def save_hf(model: CausalLM, path: str | Path, max_shard_size: int = 5 * 2**30) -> None:
    """Writes a Hub checkpoint directory that ``transformers`` loads.

    ``config.json`` (``rope_parameters`` and the older ``rope_theta`` + ``rope_scaling``) and
    safetensors in the model's dtypes: ``model.safetensors`` when everything fits one shard,
    else ``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``. A tied
    output head is not written (as transformers does).

    Args:
        model: A model of a family in ``MODEL_FAMILIES`` holding all experts.
        path: Output directory (created).
        max_shard_size: Largest shard in bytes (a tensor larger than it gets its own).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    family = next(n for n, (_, cls) in MODEL_FAMILIES.items() if type(model) is cls)
    canonical = {k: v.detach() for k, v in model.canonical_parameters().items()}
    hub = canonical_to_hub(family, canonical)
    dtype = str(model.output_weight.dtype).removeprefix("torch.")
    config = config_to_hf(model.config, dtype)
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for key in sorted(hub):
        size = hub[key].numel() * hub[key].element_size()
        if shards[-1] and shard_bytes + size > max_shard_size:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(key)
        shard_bytes += size
    names = (
        [SINGLE_NAME]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    for name, keys in zip(names, shards, strict=True):
        # Clones: canonical expert views share storage, which safetensors refuses.
        tensors = {k: hub[k].to("cpu").contiguous().clone() for k in keys}
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in hub.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
