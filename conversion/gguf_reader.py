"""Read a llama.cpp ``.gguf`` file as an HF checkpoint: config, tensors, tokenizer files.

GGUF keeps the model's config as metadata under llama.cpp key names, its weights under
llama.cpp tensor names (possibly quantized, Q/K rows permuted), and its tokenizer as a
vocabulary plus merges. This module turns all three back into what an HF ``LlamaForCausalLM``
(or ``Qwen2ForCausalLM``) directory would hold, so the rest of the converter treats a GGUF
exactly like an HF directory.

Tensors are dequantized lazily, one at a time, when read from the returned mapping: a
multi-GB GGUF never sits in memory as float32 all at once unless the caller asks for it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
SUPPORTED_TOKENIZERS = ("gpt2",)

# llama.cpp's token_type values (gguf.TokenType): CONTROL tokens are special tokens such as
# <|im_start|>; USER_DEFINED ones are added tokens that are matched whole but not special.
_CONTROL = 3
_USER_DEFINED = 4

# llama.cpp names -> HF names. Layer tensors are "blk.{i}.<name>.{weight,bias}".
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_TENSOR = re.compile(r"(\w+)\.(weight|bias)")

# Pre-tokenizer split patterns by ``tokenizer.ggml.pre``, as llama.cpp applies them. A
# vocabulary only tokenizes like the original model when text is split the way its merges
# were learned. Unlisted values get GPT-2's split (ByteLevel's built-in regex).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2"), _QWEN2_SPLIT),
}
# These split every digit off on its own before GPT-2's split (SmolLM2's own tokenizer.json
# does the same with a Digits pre-tokenizer).
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")


@dataclass(frozen=True)
class GGUFCheckpoint:
    """Everything an HF model directory would hold, rebuilt from one GGUF file."""

    config: dict[str, Any]  # HF config.json contents
    tensors: Mapping[str, np.ndarray]  # HF tensor name -> float32 array, dequantized on read
    tokenizer_files: dict[str, str | bytes]  # file name -> contents
    generation_config: dict[str, Any]


class GGUFTensors(Mapping[str, np.ndarray]):
    """HF-named view of a GGUF's tensors; each read dequantizes one tensor to float32.

    ``shape(name)`` answers without dequantizing, so a whole checkpoint can be validated
    before any weight is read.
    """

    def __init__(self, reader: gguf.GGUFReader, hf_config: dict[str, Any]) -> None:
        self._by_hf_name = {_hf_tensor_name(t.name): t for t in reader.tensors}
        # llama.cpp's converter permutes Q/K rows only for the llama architecture (to turn
        # HF's half-split rotary layout into its interleaved one); Qwen2 is stored as is.
        self._unpermute_heads: dict[str, int] = {}
        if hf_config["model_type"] == "llama":
            for i in range(hf_config["num_hidden_layers"]):
                prefix = f"model.layers.{i}.self_attn"
                self._unpermute_heads[f"{prefix}.q_proj.weight"] = hf_config["num_attention_heads"]
                self._unpermute_heads[f"{prefix}.k_proj.weight"] = hf_config["num_key_value_heads"]

    def __getitem__(self, name: str) -> np.ndarray:
        tensor = self._by_hf_name[name]
        # GGUF lists dims fastest-first (ne order); the reader's numpy view is already in
        # C order, i.e. HF's [out, in], with quantized rows as bytes until dequantized.
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        weights = weights.reshape(self.shape(name))
        if name in self._unpermute_heads:
            weights = _unpermute_rotary_rows(weights, self._unpermute_heads[name])
        return weights

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_hf_name)

    def __len__(self) -> int:
        return len(self._by_hf_name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._by_hf_name[name].shape))


def read_gguf(path: str | Path) -> GGUFCheckpoint:
    """Read a GGUF file into an HF-shaped checkpoint.

    Raises ValueError for an architecture or tokenizer model this reader does not support.
    """
    reader = gguf.GGUFReader(str(path))
    metadata = _read_metadata(reader)
    tensor_names = [t.name for t in reader.tensors]
    config = _hf_config(metadata, tensor_names, path)
    tensors = GGUFTensors(reader, config)
    tokenizer_files = _tokenizer_files(metadata, path)
    generation_config = {
        key: config[key]
        for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        if config.get(key) is not None
    }
    return GGUFCheckpoint(config, tensors, tokenizer_files, generation_config)


def _read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Metadata key -> Python value (str, int, float, bool, or list of those)."""
    return {key: field.contents() for key, field in reader.fields.items()}


def _hf_tensor_name(gguf_name: str) -> str:
    if match := _LAYER_TENSOR.fullmatch(gguf_name):
        layer, part, kind = match.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    elif (match := _GLOBAL_TENSOR.fullmatch(gguf_name)) and match.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[match.group(1)]}.{match.group(2)}"
    # Left as is: the converter's validation reports it as unexpected, with its GGUF name.
    return gguf_name


def _unpermute_rotary_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's per-head row interleave of a Q or K projection.

    llama.cpp stores each head's rows as (pair, half) -> (half, pair) swapped; swapping the two
    axes back restores HF's layout of the first rotary half followed by the second.
    """
    rows, *rest = weights.shape
    half = rows // num_heads // 2
    return weights.reshape(num_heads, half, 2, *rest).swapaxes(1, 2).reshape(weights.shape)


def _hf_config(metadata: dict[str, Any], tensor_names: list[str], path: str | Path) -> dict:
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; this converter reads "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} GGUF files. Convert the model's HF "
            "safetensors directory instead."
        )

    def key(name: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{name}", default)

    hidden_size = key("embedding_length")
    num_heads = key("attention.head_count")
    head_dim = key("attention.key_length", hidden_size // num_heads)
    vocab_size = key("vocab_size", len(metadata.get("tokenizer.ggml.tokens", ())))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": arch,
        "hidden_size": hidden_size,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": key("attention.head_count_kv", num_heads),
        "head_dim": head_dim,
        # The file stores float32; str() gives its shortest round-tripping decimal (1e-05,
        # not 9.999999747378752e-06).
        "rms_norm_eps": float(str(np.float32(key("attention.layer_norm_rms_epsilon", 1e-6)))),
        "rope_theta": float(str(np.float32(key("rope.freq_base", 10000.0)))),
        "max_position_embeddings": key("context_length"),
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        # llama.cpp writes the output projection only when it differs from the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
    }
    if arch == "llama":
        config["attention_bias"] = any(n.endswith("attn_q.bias") for n in tensor_names)
        config["mlp_bias"] = False
    if "rope_freqs.weight" in tensor_names or key("rope.scaling.type") not in (None, "none"):
        raise ValueError(
            f"{path}: this GGUF uses RoPE scaling (rope_freqs tensor or rope.scaling metadata), "
            "which the GGUF reader does not rebuild; convert the model's HF directory instead."
        )
    return config


def _tokenizer_files(metadata: dict[str, Any], path: str | Path) -> dict[str, str | bytes]:
    model = metadata.get("tokenizer.ggml.model")
    if model not in SUPPORTED_TOKENIZERS:
        raise ValueError(
            f"{path}: GGUF tokenizer model {model!r} is not supported; only byte-level BPE "
            "('gpt2') vocabularies can be rebuilt. Convert the model's HF directory instead, "
            "which carries its own tokenizer files."
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type", ()))

    def token(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None else None

    tokenizer = _byte_level_bpe(tokens, token_types, metadata)
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    if add_bos or add_eos:
        tokenizer.post_processor = _bos_eos_processor(
            token("bos_token_id") if add_bos else None,
            token("eos_token_id") if add_eos else None,
            tokenizer,
        )

    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": metadata.get(f"{metadata['general.architecture']}.context_length"),
    }
    if "tokenizer.chat_template" in metadata:
        tokenizer_config["chat_template"] = metadata["tokenizer.chat_template"]
    return {
        "tokenizer.json": tokenizer.to_str(pretty=False),
        "tokenizer_config.json": json.dumps(tokenizer_config, indent=2, ensure_ascii=False),
    }


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte value.

    Printable Latin-1 bytes stand for themselves; the other 68 byte values are mapped, in
    order, to code points from 256 up, so every byte string has a visible spelling.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 256
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(extra)
            extra += 1
    return mapping


def _byte_level_bpe(tokens: list[str], token_types: list[int], metadata: dict) -> Tokenizer:
    spelling = _byte_to_unicode()
    alphabet = set(spelling.values())

    def respell(token: str) -> str:
        # Some converters store a token's raw text instead of its byte-alphabet spelling.
        if set(token) <= alphabet:
            return token
        return "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {respell(t): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", ())]
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    pre = metadata.get("tokenizer.ggml.pre")
    if pre in _SPLIT_BY_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in _DIGITS_THEN_GPT2:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()

    # A CONTROL token spelled outside the byte alphabet is a mislabel in some files; making it
    # special would add an id past the vocabulary the model was trained with.
    special = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, token_types, strict=False)
        if kind == _CONTROL and set(t) <= alphabet
    ]
    user_defined = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, token_types, strict=False)
        if kind == _USER_DEFINED
    ]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user_defined)
    return tokenizer


def _bos_eos_processor(
    bos: str | None, eos: str | None, tokenizer: Tokenizer
) -> processors.TemplateProcessing:
    """Post-processor adding BOS/EOS around each sequence, as the GGUF's flags ask."""
    prefix = [bos] if bos else []
    suffix = [eos] if eos else []
    single = [*prefix, "$A", *suffix]
    pair = [*single, *(f"{t}:1" for t in prefix), "$B:1", *(f"{t}:1" for t in suffix)]
    return processors.TemplateProcessing(
        single=single,
        pair=pair,
        special_tokens=[(t, tokenizer.token_to_id(t)) for t in {*prefix, *suffix}],
    )
