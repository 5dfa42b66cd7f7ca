"""Builders shared by the converter and GGUF tests: tiny HF models and tiny GGUF files.

Everything here is built from a fixed seed on the CPU in well under a second, so tests can make
fresh sources instead of sharing mutable ones.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

TINY_LLAMA = dict(
    vocab_size=262,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
)


def save_tiny_llama(
    directory: Path,
    *,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    family: str = "llama",
    **overrides,
) -> dict:
    """Save a seeded random LlamaForCausalLM with safetensors; returns its fp32 state dict.

    ``overrides`` change the config; ``max_shard_size`` (e.g. "20KB") shards the weights;
    ``family="qwen2"`` saves a Qwen2ForCausalLM (Q/K/V biases) of the same shape instead.
    """
    import torch
    import transformers

    torch.manual_seed(0)
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    config = config_class(**(TINY_LLAMA | {"tie_word_embeddings": False} | overrides))
    model = model_class(config).to(getattr(torch, dtype))
    # Random init leaves norms at exactly 1 and biases at 0; perturb them so a swap is visible.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.1)
    if max_shard_size is None:
        model.save_pretrained(directory)
    else:
        model.save_pretrained(directory, max_shard_size=max_shard_size)
    return {k: v.float().numpy() for k, v in model.state_dict().items()}


def byte_alphabet() -> list[str]:
    """GPT-2's 256 byte stand-in characters, in byte order (an independent re-derivation)."""
    kept = [b for b in range(256) if chr(b).isprintable() and b not in (0x20, 0xA0, 0xAD)]
    extra = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(extra)) for b in range(256)]


def tiny_bpe_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a 262-token byte-level BPE vocabulary."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = specials + byte_alphabet() + ["Ġt", "he", "Ġthe"]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return tokens, types, merges


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows: interleave each head's two rotary halves."""
    rows = weights.shape[0]
    return (
        weights.reshape(num_heads, 2, rows // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_tiny_gguf(
    path: Path,
    state: dict[str, np.ndarray],
    *,
    arch: str = "llama",
    tokenizer_model: str = "gpt2",
    chat_template: str | None = "{{ messages[0]['content'] }}",
    config: dict | None = None,
) -> Path:
    """Write an F32 GGUF of a tiny llama state dict the way llama.cpp would lay it out."""
    config = TINY_LLAMA | (config or {})
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_vocab_size(config["vocab_size"])
    tokens, types, merges = tiny_bpe_vocab()
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    for name, value in state.items():
        value = np.ascontiguousarray(value, dtype=np.float32)
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            _, _, layer, *rest = name.split(".")
            module, kind = ".".join(rest[:-1]), rest[-1]
            gguf_name = f"blk.{layer}.{_GGUF_LAYER_NAMES[module]}.{kind}"
            if arch == "llama" and module == "self_attn.q_proj":
                value = llama_cpp_permute(value, heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                value = llama_cpp_permute(value, kv_heads)
        writer.add_tensor(gguf_name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
