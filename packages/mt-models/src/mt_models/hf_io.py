"""Import and export of Hugging Face Hub checkpoint directories.

A directory holds ``config.json`` and safetensors weights, either one
``model.safetensors`` or shards listed in ``model.safetensors.index.json``. Canonical
names (``CausalLM.canonical_parameters``) are the Hub keys, one per expert; only GPT-OSS
differs on disk: its Hub files stack the experts, transposed to [E, in, out] with
``_bias`` suffixes (``mlp.experts.gate_up_proj`` [E, D, 2F], ``gate_up_proj_bias``
[E, 2F], ``down_proj`` [E, F, D], ``down_proj_bias`` [E, D]), or store the matrices as
MXFP4 ``_blocks``/``_scales`` (dequantized on import, ``mxfp4.py``).

Import accepts exactly the model's keys, with three exceptions it drops unread: a tied
``lm_head.weight``, tensors of no values, and RoPE's ``rotary_emb.inv_freq`` buffers
(``model.layers.{i}.self_attn.rotary_emb.inv_freq``), which older transformers versions saved
and its loader still ignores: they derive from config.json, which defines our RoPE. Any other
key the model lacks is an error.
"""

import json
import math
import os
import re
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from mt_models.base import CausalLM, copy_whole_into
from mt_models.hf_config import config_from_hf, config_to_hf, family_of_hf_config
from mt_models.layers.norm import RMSNorm
from mt_models.layers.router import TopKRouter
from mt_models.mxfp4 import dequantize_mxfp4
from mt_models.registry import MODEL_FAMILIES

# A progress callback: (done, total), in Hub tensors when reading, bytes when writing.
Progress = Callable[[int, int], None]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# RoPE's inverse frequencies, a buffer older transformers saved per attention layer
# (model.layers.{i}.self_attn.rotary_emb.inv_freq): computed from config.json, never loaded.
_ROPE_INV_FREQ = re.compile(r"^(?:.*\.)?rotary_emb\.inv_freq$")
# A shard name save_hf writes (model-00001-of-00003.safetensors).
_SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
# GPT-OSS Hub key of a stacked expert tensor: <layer>.mlp.experts.<proj>[_bias].
_STACKED = re.compile(
    r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)(?P<bias>_bias)?$"
)


@dataclass(frozen=True)
class _Stored:
    """One tensor as a safetensors header describes it (no data read).

    Attributes:
        file: Name of the shard file in the checkpoint directory.
        shape: Shape on disk.
        dtype: safetensors dtype name (``"BF16"``, ``"U8"``, ...).
    """

    file: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class _HubTensor:
    """One Hub tensor as ``load_hf`` produces it, before it is read.

    Attributes:
        key: Hub key (MXFP4: the ``X`` of ``X_blocks`` + ``X_scales``).
        shape: Shape after MXFP4 dequantization ([E, I, O]); the stored shape otherwise.
        stored_key: Key whose data to read (MXFP4: ``X_blocks``).
        scales_key: ``X_scales`` for MXFP4, else None.
    """

    key: str
    shape: tuple[int, ...]
    stored_key: str
    scales_key: str | None = None


# config.json fields that decide which tensor keys a family's model has: the usual
# culprits when a checkpoint's keys and its config.json disagree.
_LAYOUT_FIELDS = {
    "qwen3_moe": "num_hidden_layers, num_experts, decoder_sparse_step and mlp_only_layers",
    "deepseek_v2": "num_hidden_layers, n_routed_experts, n_shared_experts, "
    "first_k_dense_replace and q_lora_rank",
    "gpt_oss": "num_hidden_layers and num_local_experts",
}

# safetensors header dtype → torch dtype, to infer load_hf's dtype from the embedding.
_HEADER_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}

# Dtypes `save_hf` (and `mt-train convert mt-to-hf`) write on request; the Hub's checkpoints
# come in these.
EXPORT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Hub keys transformers keeps in fp32 in a model of a lower dtype, and so saves in fp32: its
# `_keep_in_fp32_modules_strict` (bfloat16 and float16) and `_keep_in_fp32_modules` (float16
# alone) of models/<family>/modeling_<family>.py (transformers 5), patterns it searches for
# in each key. DeepSeek-V2 lists "gate.weight", which of our keys only the router's hold;
# GPT-OSS "input_layernorm", "post_attention_layernorm" and "norm", which only its RMSNorm
# weights hold; Qwen3-MoE lists none.
_KEEP_FP32: dict[str, dict[torch.dtype, re.Pattern]] = {
    "deepseek_v2": dict.fromkeys(
        (torch.bfloat16, torch.float16), re.compile(r"^model\.layers\.\d+\.mlp\.gate\.weight$")
    ),
    "gpt_oss": {
        torch.float16: re.compile(
            r"^model\.(?:norm|layers\.\d+\.(?:input|post_attention)_layernorm)\.weight$"
        )
    },
}


def _read_json_object(file: Path) -> dict[str, Any]:
    """The JSON object in ``file``; ValueError naming the file when it is not one (json's
    own error names no file)."""
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} is not valid JSON ({err}); download or copy it again") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} holds a JSON {type(data).__name__}, not an object")
    return data


def _checkpoint_files(path: Path) -> list[str]:
    """Names of the directory's safetensors files: the single file, else the index's shards
    (transformers' order, so both read the same weights from a directory holding both),
    else every ``*.safetensors``."""
    index = path / INDEX_NAME
    if (path / SINGLE_NAME).exists():
        files = [SINGLE_NAME]
    elif index.exists():
        weight_map = _read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(
                f'{index} has no "weight_map" object (tensor key → shard file); download it again'
            )
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no safetensors weights in {path}; expected {SINGLE_NAME} or {INDEX_NAME}"
        )
    absent = [name for name in files if not (path / name).is_file()]
    if absent:
        raise ValueError(
            f"{path / INDEX_NAME} lists {len(absent)} shard(s) missing from {path}, e.g. "
            f"{absent[:3]}; download them again (an interrupted download or copy)"
        )
    return files


def _read_headers(path: Path, handles: dict[str, Any]) -> dict[str, _Stored]:
    """Stored key → file, shape and dtype of every tensor, from the headers alone.

    Args:
        path: The checkpoint directory (for error messages).
        handles: File name → open ``safe_open`` handle.

    Returns:
        Key → ``_Stored``, files in the order given, keys in each file's order.
    """
    headers: dict[str, _Stored] = {}
    for name, f in handles.items():
        for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            if key in headers:
                raise ValueError(
                    f"{key} is stored twice in {path}: in {headers[key].file} and {name}; "
                    f"remove one copy (or fix {INDEX_NAME})"
                )
            tensor_slice = f.get_slice(key)
            headers[key] = _Stored(name, tuple(tensor_slice.get_shape()), tensor_slice.get_dtype())
    return headers


def _hub_tensors(headers: dict[str, _Stored]) -> dict[str, _HubTensor]:
    """Pairs MXFP4 ``X_blocks`` [E, O, I/32, 16] + ``X_scales`` [E, O, I/32] into the Hub's
    ``X`` [E, I, O] (possibly from different shards); every other key stands alone.

    Args:
        headers: Stored key → ``_Stored``.

    Returns:
        Hub key → ``_HubTensor``, in stored order.
    """
    out = {}
    for key, stored in headers.items():
        if key.endswith("_scales") and key[: -len("_scales")] + "_blocks" in headers:
            continue  # read with its _blocks; a lone _scales stands alone (and is unexpected)
        if not key.endswith("_blocks"):
            out[key] = _HubTensor(key, stored.shape, key)
            continue
        base = key[: -len("_blocks")]
        scales = headers.get(base + "_scales")
        if scales is None:
            raise ValueError(f"{key} has no matching {base}_scales in the checkpoint")
        if len(stored.shape) != 4 or stored.shape[:-1] != scales.shape:
            raise ValueError(
                f"{key} shape {stored.shape} must be {base}_scales shape {scales.shape} "
                f"plus one dim of packed bytes, 4 dims in all ([E, O, I/32, 16])"
            )
        *lead, dim_out, num_groups, num_bytes = stored.shape
        shape = (*lead, num_groups * 2 * num_bytes, dim_out)  # [E, I, O]
        out[base] = _HubTensor(base, shape, key, base + "_scales")
    return out


def _read_hub_tensor(
    hub_tensor: _HubTensor,
    headers: dict[str, _Stored],
    handles: dict[str, Any],
    dtype: torch.dtype,
) -> Tensor:
    """Reads one Hub tensor (MXFP4: its blocks and scales, one expert dequantized at a time).

    Args:
        hub_tensor: What to read.
        headers: Stored key → ``_Stored`` (which file holds each key).
        handles: File name → open ``safe_open`` handle.
        dtype: Dtype of dequantized MXFP4 values.

    Returns:
        The tensor, shape ``hub_tensor.shape``.
    """
    stored = handles[headers[hub_tensor.stored_key].file].get_tensor(hub_tensor.stored_key)
    if hub_tensor.scales_key is None:
        return stored
    scales = handles[headers[hub_tensor.scales_key].file].get_tensor(hub_tensor.scales_key)
    # One leading slice (expert) at a time: dequantize_mxfp4's int64/float32 temporaries
    # are several times the output, so the whole stack at once would dwarf the tensor.
    *lead, dim_in, dim_out = hub_tensor.shape
    weight_EOI = torch.empty((*lead, dim_out, dim_in), dtype=dtype)
    for e in range(stored.shape[0]):
        weight_EOI[e] = dequantize_mxfp4(stored[e], scales[e], dtype)
    return weight_EOI.transpose(-2, -1)  # [E, I, O]


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


def _check_against_model(
    path: Path, family: str, hub_tensors: dict[str, _HubTensor], targets: dict[str, Tensor]
) -> None:
    """Raises unless the checkpoint yields exactly the model's canonical keys and shapes.

    Uses shapes only: each Hub tensor goes through ``hub_to_canonical`` as a meta tensor,
    the same mapping ``load_hf`` then applies to its data.

    Args:
        path: The checkpoint directory (for error messages).
        family: The family name.
        hub_tensors: Hub key → ``_HubTensor`` (a tied ``lm_head.weight`` already dropped).
        targets: The model's canonical key → parameter (meta is fine).
    """
    shapes = _canonical_shapes(family, hub_tensors)
    missing = sorted(set(targets) - set(shapes))
    unexpected = sorted(set(shapes) - set(targets))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match its config.json: missing {missing[:5]} "
            f"({len(missing)} in all), unexpected {unexpected[:5]} ({len(unexpected)} in all); "
            f"the weights and config.json (model_type {family!r}) describe different models: "
            f"put the config.json saved with these weights in {path}, or correct its "
            f"{_LAYOUT_FIELDS[family]} to match the weights"
        )
    for key, target in targets.items():
        if shapes[key] != tuple(target.shape):
            raise ValueError(
                f"{key}: checkpoint shape {shapes[key]} != model shape "
                f"{tuple(target.shape)}; the weights do not fit config.json"
            )


@torch.no_grad()
def _copy_hub_tensor(family: str, key: str, tensor: Tensor, targets: dict[str, Tensor]) -> None:
    """Copies one Hub tensor into the canonical parameters among ``targets``.

    Args:
        family: The family name.
        key: Hub key of ``tensor``.
        tensor: Its data (GPT-OSS: possibly a stack of experts).
        targets: Canonical key → parameter this process holds (an FSDP2 DTensor gets its
            local piece); canonical keys it does not hold are skipped.
    """
    for canonical_key, source in hub_to_canonical(family, {key: tensor}).items():
        if canonical_key in targets:
            copy_whole_into(targets[canonical_key], source)


def _canonical_of(family: str, hub_tensor: _HubTensor) -> dict[str, Tensor]:
    """``hub_to_canonical`` of a Hub tensor's shape (meta tensors: no data read)."""
    meta = torch.empty(hub_tensor.shape, device="meta")
    return hub_to_canonical(family, {hub_tensor.key: meta})


def _canonical_shapes(family: str, hub_tensors: dict[str, _HubTensor]) -> dict[str, tuple]:
    """Canonical key → shape of everything the Hub tensors map to."""
    return {
        key: tuple(tensor.shape)
        for hub_tensor in hub_tensors.values()
        for key, tensor in _canonical_of(family, hub_tensor).items()
    }


def _open_shard(file: Path, stack: ExitStack) -> Any:
    """``safe_open`` of one weights file; a damaged one raises ValueError naming it (the
    safetensors error alone does not say which of the shards is truncated)."""
    try:
        return stack.enter_context(safe_open(file, framework="pt"))
    except SafetensorError as err:
        raise ValueError(
            f"{file} is not a readable safetensors file ({err}); download or copy it again "
            "(an interrupted download or copy leaves it truncated)"
        ) from None


def read_hf_config(path: str | Path) -> tuple[str, Any]:
    """The family and model config of a Hub checkpoint directory's ``config.json``.

    Args:
        path: The checkpoint directory.

    Returns:
        (family name, family config).

    Raises:
        ValueError: naming the directory or file when config.json is missing, not a JSON
            object, or describes no model this version builds.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{path} has no config.json: load_hf reads a local checkpoint directory; for a "
            f"Hub repo id, download it first (huggingface-cli download {path} --local-dir "
            "<dir>) and pass that directory"
        )
    data = _read_json_object(path / "config.json")
    try:
        return family_of_hf_config(data), config_from_hf(data)
    except ValueError as err:
        raise ValueError(f"{path / 'config.json'}: {err}") from None


class _HubCheckpoint:
    """An open Hub checkpoint directory: family, config and tensor headers, no data read."""

    def __init__(self, path: Path, stack: ExitStack):
        self.path = path
        self.family, self.config = read_hf_config(path)
        self.handles = {name: _open_shard(path / name, stack) for name in _checkpoint_files(path)}
        self.headers = _read_headers(path, self.handles)
        # Tensors of no values carry nothing to load: transformers' DeepSeek-V2 always builds
        # its shared_experts MLP, of intermediate size 0 when n_shared_experts is 0, and
        # saves those empty weights; our model has no such module. RoPE inv_freq buffers of
        # older files are derived from config.json (transformers ignores them too).
        self.hub_tensors = {
            key: hub_tensor
            for key, hub_tensor in _hub_tensors(self.headers).items()
            if math.prod(hub_tensor.shape) > 0 and not _ROPE_INV_FREQ.match(key)
        }
        if self.config.tie_word_embeddings:
            self.hub_tensors.pop("lm_head.weight", None)  # tied: never read

    def copy_into(
        self, targets: dict[str, Tensor], dtype: torch.dtype, progress: Progress | None = None
    ) -> None:
        """Reads, maps and copies one Hub tensor at a time (read as ``dtype``), skipping
        those that give no key of ``targets``; ``progress(done, total)`` after each."""
        wanted = [
            hub_tensor
            for hub_tensor in self.hub_tensors.values()
            if any(k in targets for k in _canonical_of(self.family, hub_tensor))
        ]
        for done, hub_tensor in enumerate(wanted, 1):
            # Read inside the call, so it is freed before the next read.
            _copy_hub_tensor(
                self.family,
                hub_tensor.key,
                _read_hub_tensor(hub_tensor, self.headers, self.handles, dtype),
                targets,
            )
            if progress is not None:
                progress(done, len(wanted))


def load_hf(
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    progress: Progress | None = None,
) -> CausalLM:
    """Builds a model from a Hub checkpoint directory.

    Streams: keys and shapes are checked against the model from the safetensors headers
    before any tensor is read, then one Hub tensor at a time (GPT-OSS: one stacked expert
    tensor, or one MXFP4 blocks + scales pair) is read, mapped and copied into the model.
    Peak host memory is the model plus about one checkpoint tensor. The checkpoint must
    hold exactly the model's keys; a tied ``lm_head.weight``, empty tensors and the
    per-layer ``rotary_emb.inv_freq`` buffers of older files are dropped unread.

    Args:
        path: Directory with ``config.json`` and safetensors weights (sharded or not).
        dtype: Parameter dtype; None keeps the checkpoint's: its embedding's dtype, and
            fp32 for router and RMSNorm parameters stored in fp32 (``keep_stored_fp32``:
            transformers keeps DeepSeek-V2's ``gate.weight`` fp32 in a bfloat16 or float16
            model, GPT-OSS's norms in a float16 one, and saves them so), so ``save_hf``
            gives the checkpoint back.
        device: Where the parameters live.
        progress: Called as ``progress(done, total)`` after each Hub tensor is read
            (``total`` Hub tensors in all), for a progress display.

    Returns:
        The model, every parameter set from the checkpoint.
    """
    keep_stored = dtype is None
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"dtype ({dtype!r}) must be a torch.dtype such as torch.bfloat16, or None for the "
            "checkpoint's own (what transformers calls 'auto')"
        )
    path = Path(path)
    with ExitStack() as stack:
        hub = _HubCheckpoint(path, stack)
        if dtype is None:
            embed = hub.headers.get("model.embed_tokens.weight")
            dtype = torch.float32 if embed is None else _HEADER_DTYPES.get(embed.dtype)
            if dtype is None:
                raise ValueError(
                    f"model.embed_tokens.weight in {path / embed.file} has dtype {embed.dtype}, "
                    f"not one of {sorted(_HEADER_DTYPES)}; pass load_hf(..., dtype=...)"
                )
        with torch.device("meta"):
            model = MODEL_FAMILIES[hub.family][1](hub.config)
        model.to(dtype)  # on meta, so to_empty allocates the model once, in dtype
        if keep_stored:
            keep_stored_fp32(model, {k for k, v in hub.headers.items() if v.dtype == "F32"})
        _check_against_model(path, hub.family, hub.hub_tensors, model.canonical_parameters())
        model.to_empty(device=device)
        hub.copy_into(model.canonical_parameters(), dtype, progress)
    return model


def keep_stored_fp32(model: CausalLM, fp32_keys: set[str]) -> None:
    """Turns (on meta) each router and RMSNorm parameter stored in fp32 back to fp32 when
    the model is in a lower dtype.

    transformers keeps some of them fp32 in a model of a lower dtype and saves them so
    (``_KEEP_FP32``: DeepSeek-V2's ``gate.weight`` in bfloat16 and float16, GPT-OSS's
    norms in float16); a model cast whole would round them (and route otherwise), and
    saving it would not give the checkpoint back. Only these two kinds: both compute in
    fp32 whatever the input's dtype and return it (``TopKRouter``; ``rms_norm`` takes an
    fp32 weight with a half-precision ``x``, kernel or eager), while any other parameter
    kept fp32 (a projection's weight, the embedding) would meet half-precision
    activations in a matmul and fail; those take the model's dtype.

    Args:
        model: The meta-device model, already in the load dtype.
        fp32_keys: Keys stored in fp32 (Hub or canonical: router and norm keys are the same
            in both).
    """
    for prefix, module in model.named_modules():
        if not isinstance(module, (TopKRouter, RMSNorm)):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            lower = param.is_floating_point() and param.element_size() < 4
            if lower and f"{prefix}.{name}" in fp32_keys:
                module.register_parameter(
                    name, torch.nn.Parameter(param.float(), requires_grad=param.requires_grad)
                )


def load_hf_into(model: CausalLM, path: str | Path) -> Any:
    """Copies a Hub checkpoint's weights into an existing model of the same architecture.

    The model may hold part of its parameters: some experts (expert parallelism),
    FSDP2 shards, whose local pieces are filled, or some layers (parameters left on the
    meta device are skipped); no process needs the whole model. Keys
    and shapes are checked first, against a meta-device model of ``model.config``, from
    the safetensors headers; then Hub tensors are read one at a time (those that give
    nothing this process holds are not read) and cast to the parameters' dtypes.

    Args:
        model: The model to fill (its config must describe the checkpoint's architecture).
        path: Directory with ``config.json`` and safetensors weights.

    Returns:
        The checkpoint's model config (from its ``config.json``).
    """
    path = Path(path)
    with ExitStack() as stack:
        hub = _HubCheckpoint(path, stack)
        family = _family_of(model)
        if hub.family != family:
            raise ValueError(
                f"{path} holds a {hub.family} model but the model is {family}; choose a "
                "model of the checkpoint's family"
            )
        with torch.device("meta"):
            whole = MODEL_FAMILIES[family][1](model.config)
        shapes = _canonical_shapes(hub.family, hub.hub_tensors)
        expected = {k: tuple(v.shape) for k, v in whole.canonical_parameters().items()}
        missing = sorted(set(expected) - set(shapes))
        if missing:
            raise ValueError(
                f"{path} lacks {len(missing)} parameter(s) of the model, e.g. {missing[:3]}; "
                "the model's config must describe the checkpoint's architecture"
            )
        extra = sorted(set(shapes) - set(expected))
        if extra:
            raise ValueError(
                f"{path} holds {len(extra)} parameter(s) the model lacks, e.g. {extra[:3]}; "
                "the model's config must describe the checkpoint's architecture"
            )
        for key, shape in expected.items():
            if shapes[key] != shape:
                raise ValueError(
                    f"{key}: {path} has shape {shapes[key]} but the model has {shape}; the "
                    "model's config must describe the checkpoint's architecture"
                )
        # Parameters left on the meta device hold nothing to fill (a pipeline rank's model
        # materializes its own stages only).
        targets = {k: v.detach() for k, v in model.canonical_parameters().items()
                   if v.device.type != "meta"}  # fmt: skip
        dtypes = {t.dtype for t in targets.values()}
        hub.copy_into(targets, dtypes.pop() if len(dtypes) == 1 else torch.float32)
    return hub.config


def _family_of(model: CausalLM) -> str:
    """The family name of a model (isinstance: FSDP2 subclasses the module it wraps)."""
    return next(name for name, (_, cls) in MODEL_FAMILIES.items() if isinstance(model, cls))


def save_hf(
    model: CausalLM,
    path: str | Path,
    max_shard_size: int = 5 * 2**30,
    dtype: torch.dtype | None = None,
) -> None:
    """Writes a Hub checkpoint directory that ``transformers`` loads.

    ``config.json`` (``rope_parameters`` and the older ``rope_theta`` + ``rope_scaling``) and
    safetensors in the model's dtypes, or in ``dtype`` (as ``mt-train convert mt-to-hf
    --dtype``): ``model.safetensors`` when everything fits one shard, else
    ``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``. A tied
    output head is not written (as transformers does). Files are written into ``path`` as
    they are made; a caller that needs all-or-nothing writes to a new directory and renames
    it (as ``mt-train convert mt-to-hf`` does). Weights of an earlier save into the same
    directory (``model.safetensors``, the index, ``model-*-of-*`` shards) are removed first,
    as ``save_pretrained`` does: left there, an old ``model.safetensors`` would win over new
    shards (``load_hf`` and transformers read it first), and old shards would stay on disk.

    Args:
        model: A model of a family in ``MODEL_FAMILIES`` holding all experts.
        path: Output directory (created; earlier weights in it are replaced).
        max_shard_size: Largest shard in bytes (a tensor larger than it gets its own).
        dtype: None writes each parameter in its own dtype, config.json naming the output
            weight's; one of ``EXPORT_DTYPES`` writes every floating-point tensor in it and
            names it in config.json, except what transformers keeps in fp32 in a model of
            that dtype and saves so (DeepSeek-V2's router ``mlp.gate.weight`` in bfloat16 and
            float16, GPT-OSS's RMSNorm weights in float16), written in fp32. The model is
            not changed: the cast copies (on the model's device) are made before the first
            file is written, so memory grows by the tensors whose dtype changes.
    """
    if dtype is not None and dtype not in EXPORT_DTYPES:  # before anything is removed
        raise ValueError(
            f"dtype ({dtype!r}) must be torch.bfloat16, torch.float16 or torch.float32, or "
            "None to write each parameter in its own dtype"
        )
    family = _family_of(model)
    canonical = {k: v.detach() for k, v in model.canonical_parameters().items()}
    if dtype is None:
        dtype = model.output_weight.dtype  # config.json's
    else:  # replaces the dict's entries, not the parameters
        cast_to_hub_dtype(family, canonical, dtype)
    save_hf_tensors(family, model.config, canonical, Path(path), max_shard_size, dtype)


def save_hf_tensors(
    family: str,
    config: Any,
    canonical: dict[str, Tensor],
    path: str | Path,
    max_shard_size: int,
    dtype: torch.dtype,
    progress: Progress | None = None,
) -> None:
    """Writes ``save_hf``'s files from canonical tensors, without needing a model.

    Shards are planned from shapes alone (``canonical_to_hub`` on meta tensors); each
    shard's Hub tensors are then made when it is written (GPT-OSS: only its own expert
    stacks) and freed before the next, so beyond ``canonical`` peak memory is about one
    shard. A tensor is copied only when safetensors needs it: off the CPU, not contiguous,
    or a view of a larger storage (canonical experts of a model share its stack).

    Args:
        family: The family name.
        config: The family's model config (written as ``config.json``).
        canonical: Canonical key → tensor, exactly the model's ``canonical_parameters``
            keys (a tied output head left out); written in their own dtypes.
        path: Output directory (created).
        max_shard_size: Largest shard in bytes (a tensor larger than it gets its own).
        dtype: The model's dtype for ``config.json`` (its output weight's).
        progress: Called as ``progress(done, total)`` in bytes after each shard is
            written, for a progress display.
    """
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int):
        # Checked before the earlier weights are removed, which a failure would leave gone.
        raise ValueError(
            f"max_shard_size ({max_shard_size!r}) must be a number of bytes (an int, e.g. "
            "5 * 2**30), not a size string like transformers' '5GB'"
        )
    if max_shard_size < 1:  # 0 would put every tensor in a shard of its own
        raise ValueError(
            f"max_shard_size ({max_shard_size}) must be a number of bytes >= 1, e.g. 5 * 2**30"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _remove_earlier_weights(path)
    hub_meta = canonical_to_hub(
        family,
        {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in canonical.items()},
    )
    sources = {  # Hub key → the canonical keys it is made of
        key: list(hub_to_canonical(family, {key: tensor})) for key, tensor in hub_meta.items()
    }
    hf_config = config_to_hf(config, str(dtype).removeprefix("torch."))
    (path / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    sizes = {key: t.numel() * t.element_size() for key, t in hub_meta.items()}
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for key in sorted(hub_meta):
        if shards[-1] and shard_bytes + sizes[key] > max_shard_size:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(key)
        shard_bytes += sizes[key]
    names = (
        [SINGLE_NAME]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    for name, keys in zip(names, shards, strict=True):
        hub = canonical_to_hub(family, {c: canonical[c] for k in keys for c in sources[k]})
        tensors = {k: _standalone(hub[k]) for k in keys}
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        # safetensors 0.8 writes through a 0600 temporary file (safetensors issue #782):
        # give the shard config.json's mode, so whoever may read the config may read it.
        os.chmod(path / name, (path / "config.json").stat().st_mode & 0o777)
        del hub, tensors  # this shard's stacks and copies, before the next shard's
        weight_map.update(dict.fromkeys(keys, name))
        if progress is not None:
            progress(sum(sizes[k] for k in weight_map), sum(sizes.values()))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (path / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def cast_to_hub_dtype(family: str, tensors: dict[str, Tensor], dtype: torch.dtype) -> None:
    """Casts ``tensors`` in place to the dtypes transformers saves a model of ``dtype`` in.

    Every floating-point tensor becomes ``dtype``, except what transformers keeps in fp32 in
    a model of that dtype (and so saves in fp32): in bfloat16 or float16 DeepSeek-V2's router
    ``mlp.gate.weight``, in float16 also GPT-OSS's RMSNorm weights (``input_layernorm``,
    ``post_attention_layernorm``, ``model.norm``); those become fp32. Integer and bool
    tensors stay as they are. One tensor at a time, each replacing its entry, so peak memory
    grows by at most one tensor (the old one is freed when nothing else holds it).

    Args:
        family: The family name.
        tensors: Canonical (or Hub) key → tensor; entries are replaced.
        dtype: The model's dtype (``config.json``'s).
    """
    keep_fp32 = _KEEP_FP32.get(family, {}).get(dtype)
    for key, tensor in tensors.items():
        if not tensor.is_floating_point():
            continue
        kept = keep_fp32 is not None and keep_fp32.match(key)
        # Replaces the entry: the old tensor is freed (when the dict held its last
        # reference) as the loop moves on, before the next cast.
        tensors[key] = tensor.to(torch.float32 if kept else dtype)


def _remove_earlier_weights(path: Path) -> None:
    """Deletes the weight files an earlier ``save_hf`` (or ``save_pretrained``) left in
    ``path``; the index first, so an interrupted removal never leaves an index naming
    missing shards.

    Args:
        path: The output directory.
    """
    (path / INDEX_NAME).unlink(missing_ok=True)
    (path / SINGLE_NAME).unlink(missing_ok=True)
    for shard in path.glob("model-*-of-*.safetensors"):
        if _SHARD_NAME.match(shard.name):
            shard.unlink()


def _standalone(tensor: Tensor) -> Tensor:
    """``tensor`` as safetensors writes it: on the CPU, contiguous, owning all its storage.

    Returned as is when it already is (no copy); copied otherwise, since ``save_file``
    refuses tensors of one file that share storage (a model's canonical expert views).

    Args:
        tensor: Any dense tensor.

    Returns:
        The tensor or a CPU copy of it.
    """
    tensor = tensor.detach().to("cpu")
    whole = tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes()
    if tensor.is_contiguous() and tensor.storage_offset() == 0 and whole:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)
