"""Sampling text from a checkpoint: ``mt-train generate --checkpoint DIR --prompt TEXT``.

One process on CPU or one GPU, no KV cache: each new token re-runs the model on the
whole sequence (fine for looking at a checkpoint, not for serving). The tokenizer is the
checkpoint directory's ``tokenizer.json``, else the one named by the run's corpus
manifest (``data.path``; an error when it cannot be found), else mt-data's default
tokenizer for a run on the default corpus (a model-only checkpoint without one is an
error). Special tokens written in the prompt (a chat template's) are encoded as their
ids, as Hugging Face tokenizers do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mt_data.tokenizer import load_tokenizer
from mt_models import CausalLM, build_model
from mt_models.hf_io import keep_stored_fp32
from mt_train.checkpoint import load_model_weights
from mt_train.convert import (
    checkpoint_model_config,
    checkpoint_model_tensors,
    training_special_ids,
    training_tokenizer,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer


def sample_next(
    logits_V: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator
) -> int:
    """Picks the next token: greedy at temperature 0, else nucleus (top-p) sampling.

    Args:
        logits_V: the last position's logits [V].
        temperature: 0 for greedy; otherwise logits are divided by it.
        top_p: keep the smallest set of tokens whose probability reaches top_p.
        generator: the random source.

    Returns:
        The token id.
    """
    if temperature <= 0:
        return int(logits_V.argmax())
    # Shifted so the largest is 0: a tiny temperature then sends the others to -inf
    # instead of overflowing the largest to inf (a NaN softmax).
    shifted_V = logits_V.double() - logits_V.max().double()
    probs_V = torch.softmax(shifted_V / temperature, dim=-1)
    sorted_V, order_V = probs_V.sort(descending=True)
    # Keep a token while the mass before it is below top_p (the first is always kept).
    keep_V = sorted_V.cumsum(-1) - sorted_V < top_p
    sorted_V = sorted_V * keep_V
    choice = torch.multinomial(sorted_V / sorted_V.sum(), 1, generator=generator)
    return int(order_V[choice])


def encode_prompt(tokenizer: Tokenizer, prompt: str, add_special_tokens: bool = True) -> list[int]:
    """The ids of a prompt, special tokens in its text included, as Hugging Face encodes it.

    mt-data's tokenizer reads special tokens in documents as plain text (the builder alone
    decides where documents end); a prompt written for a converted chat model (its
    template's ``<|im_start|>`` and the like) needs them as the special ids.

    Args:
        tokenizer: the training tokenizer (mt-data's ``load_tokenizer``).
        prompt: the text to encode.
        add_special_tokens: apply the tokenizer's post-processor (a BOS it adds), as
            Hugging Face does; mt-data stores documents without it.

    Returns:
        The token ids.
    """
    saved = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = False
    try:
        return tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids
    finally:
        tokenizer.encode_special_tokens = saved


def decode_continuation(tokenizer: Tokenizer, prompt_ids: list[int], new_ids: list[int]) -> str:
    """The text that new tokens add after a prompt's.

    Decoded together with the prompt, then the prompt's text cut off: a decoder that treats
    the first token it sees specially (sentencepiece's Metaspace drops its leading space,
    a WordLevel one joins tokens with spaces) would otherwise glue the new text to the
    prompt ("Hello" + "▁world" → "Helloworld").

    Args:
        tokenizer: the tokenizer of both.
        prompt_ids: the prompt's ids.
        new_ids: the ids generated after them.

    Returns:
        The new text, with the separator the decoder puts before it.
    """
    head = tokenizer.decode(prompt_ids)
    whole = tokenizer.decode(prompt_ids + new_ids)
    if whole.startswith(head):
        return whole[len(head) :]
    return tokenizer.decode(new_ids)  # a decoder that rewrites the prompt's end: alone


def generation_config_eos_ids(checkpoint: Path) -> list[int]:
    """The ``eos_token_id`` (one id or a list) of the checkpoint's generation_config.json,
    where transformers' ``generate`` stops too (GPT-OSS: ``<|return|>``, ``<|endoftext|>``
    and ``<|call|>``); empty without the file or the field.

    Args:
        checkpoint: the checkpoint directory (``hf-to-mt`` copies the file there).

    Returns:
        The ids.
    """
    path = checkpoint / "generation_config.json"
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); copy it again or remove it") from None
    ids = data.get("eos_token_id") if isinstance(data, dict) else None
    ids = [ids] if isinstance(ids, int) else ids or []
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise ValueError(
            f"{path}: eos_token_id ({ids!r}) must be a token id or a list of them; fix or "
            "remove the file"
        )
    return ids


def load_checkpoint_model(
    checkpoint: str | Path, device: str = "cpu", model_config: Any = None
) -> CausalLM:
    """The model of an mt checkpoint, in eval mode: parameters in the embedding's dtype,
    router and RMSNorm parameters stored in fp32 (a bfloat16 DeepSeek-V2's routers, a
    float16 GPT-OSS's norms, from transformers) in fp32 (`keep_stored_fp32`).

    The tensors are read straight into the model's (host or device memory holds the model
    once), after their keys and shapes are checked against its config.

    Args:
        checkpoint: an mt checkpoint (a run's ``step_N`` or ``convert hf-to-mt`` output).
        device: where the parameters live.
        model_config: its `checkpoint_model_config`, when the caller has read it already;
            read here when None.

    Returns:
        The model.
    """
    checkpoint = Path(checkpoint)
    if model_config is None:
        model_config = checkpoint_model_config(checkpoint)
    stored = checkpoint_model_tensors(checkpoint)
    with torch.device("meta"):
        model = build_model(model_config)
    embed = stored.get("model.embed_tokens.weight")
    # On meta, so to_empty allocates once; fp32 routers and norms of a half model stay fp32.
    model.to(torch.float32 if embed is None else embed[1])  # none: a load error names it
    keep_stored_fp32(model, {k for k, (_, dtype) in stored.items() if dtype == torch.float32})
    model.to_empty(device=device)
    load_model_weights(
        checkpoint,
        model,
        "the checkpoint is damaged or from another version; give another checkpoint",
        "give another checkpoint",
    )
    return model.eval()


def generate(
    checkpoint: str | Path,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 0.9,
    seed: int = 0,
    device: str = "cpu",
) -> str:
    """Continues `prompt` with a checkpoint's model.

    Args:
        checkpoint: an mt checkpoint (a run's ``step_N`` or ``convert hf-to-mt`` output).
        prompt: the text to continue.
        max_new_tokens: tokens to add (fewer when the model emits EOS: the corpus's (its
            manifest's ``eos_id``), else the tokenizer's, or an ``eos_token_id`` of the
            checkpoint's generation_config.json).

    The prompt is encoded as the run's corpus stored documents (its manifest's BOS, when
    built with one, then the text without the tokenizer's post-processor); a model-only
    checkpoint's as Hugging Face encodes it.
        temperature: 0 for greedy decoding.
        top_p: nucleus mass when sampling.
        seed: seeds sampling.
        device: where the model runs.

    Returns:
        The prompt followed by the generated text.
    """
    if max_new_tokens < 0 or not 0 < top_p <= 1 or not temperature >= 0:  # NaN fails too
        raise ValueError(
            f"--max-new-tokens ({max_new_tokens}) must be >= 0, --top-p ({top_p}) in (0, 1] "
            f"and --temperature ({temperature}) >= 0"
        )
    try:
        device_type = torch.device(device).type
    except RuntimeError:  # "tpu", "gpu", ...
        device_type = None
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"--device ({device!r}) must be cpu, cuda or cuda:N")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is available here; use --device cpu")
    index = torch.device(device).index if device_type == "cuda" else None
    if index is not None and index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        names = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise ValueError(
            f"--device {device}: this machine has {count} CUDA device"
            f"{'' if count == 1 else 's'} ({names}); choose one of them"
        )
    checkpoint = Path(checkpoint)
    tokenizer_path = training_tokenizer(checkpoint)
    if tokenizer_path is None:  # model-only: any other tokenizer turns ids into other text
        raise ValueError(
            f"checkpoint {checkpoint} holds no tokenizer.json (converted from a directory "
            f"without one) and names no corpus to find it by; copy the model's tokenizer.json "
            f"into {checkpoint}"
        )
    # The prompt is checked against the config's vocabulary before the weights are read.
    model_config = checkpoint_model_config(checkpoint)
    vocab_size = model_config.vocab_size
    tokenizer = load_tokenizer(tokenizer_path)
    corpus = training_special_ids(checkpoint)
    if corpus is None:  # model-only: encoded as Hugging Face does (its post-processor's BOS)
        eos_id, ids = tokenizer.eos_id, encode_prompt(tokenizer.tokenizer, prompt)
    else:  # as mt-data stored the documents: [BOS] + text, the corpus's EOS
        eos_id = tokenizer.eos_id if corpus[0] is None else corpus[0]
        bos = [] if corpus[1] is None else [corpus[1]]
        ids = bos + encode_prompt(tokenizer.tokenizer, prompt, add_special_tokens=False)
    if not ids:
        ids = [eos_id]  # start a fresh document
    outside = [i for i in ids if i >= vocab_size]
    if outside:
        raise ValueError(
            f"the prompt's token {outside[0]} ({tokenizer.tokenizer.id_to_token(outside[0])!r}) "
            f"is outside the model's vocabulary (vocab_size {vocab_size}): the "
            f"tokenizer {tokenizer_path} ({tokenizer.vocab_size} tokens) is not the model's; "
            f"copy the model's tokenizer.json into {checkpoint}"
        )
    stop_ids = {eos_id, *generation_config_eos_ids(checkpoint)}
    model = load_checkpoint_model(checkpoint, device, model_config)
    generator = torch.Generator().manual_seed(seed)
    new = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            input_ids = torch.tensor([ids + new], device=device)
            logits_V = model(input_ids)[0, -1].cpu()
            token = sample_next(logits_V, temperature, top_p, generator)
            if token in stop_ids:
                break
            new.append(token)
    return prompt + decode_continuation(tokenizer.tokenizer, ids, new)
