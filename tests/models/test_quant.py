"""Quantized models on every path: LoRA on a quantized base, the engine, the fp8 K/V cache.

The oracle of a quantized model is HF's model holding the dequantized weights (``q * scale``,
exact in fp32); PEFT's adapters on that model are the oracle of adapters on a quantized base.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import make_peft, random_prompt

import spark_jax as sj
from spark_jax.config import QuantizationConfig
from spark_jax.models import declare
from spark_jax.ops.quant import dequantize


@pytest.fixture(scope="module")
def quantized(tiny_llama):
    """(HF twin holding the dequantized weights, our int8 model) of the tiny Llama."""
    hf, model = tiny_llama
    config = dataclasses.replace(model.config, quantization=QuantizationConfig("int8"))
    params = declare(config).quantize(model.params)
    twin = type(hf)(hf.config).eval()
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    for p in declare(config).quantized:
        node = params
        for key in p.path[:-1]:
            node = node[key]
        kernel = np.asarray(dequantize(node["kernel"], node["kernel_scale"]))  # [in, out]
        start = 0
        for name, (out_dim, _) in zip(p.hf, p.shapes, strict=True):
            state[name] = torch.from_numpy(kernel[:, start : start + out_dim].T.copy())
            start += out_dim
    twin.load_state_dict(state)
    return twin, sj.Model(config, params)


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_the_quantized_model_matches_its_dequantized_hf_twin(quantized):
    twin, model = quantized
    ids = random_prompt(5, 24)
    np.testing.assert_allclose(model.logits(ids), hf_logits(twin, ids), atol=1e-4, rtol=1e-4)


def test_lora_adapters_stay_float_on_a_quantized_base_and_match_peft(quantized, tmp_path_factory):
    twin, base = quantized
    model = sj.Model(base.config, base.params)
    peft = make_peft(
        twin, seed=3, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]
    )
    path = tmp_path_factory.mktemp("adapter")
    peft.save_pretrained(path)
    model.add_adapter("a", path)
    qkv = model.params["layers_0"]["attn"]["qkv_proj"]["kernel"]
    assert qkv.dtype == jnp.int8 and qkv.shape == (64, 128)  # never widened with A columns
    ids = random_prompt(6, 20)
    np.testing.assert_allclose(
        model.logits(ids, adapter="a"), hf_logits(peft, ids), atol=1e-4, rtol=1e-4
    )
    with pytest.raises(ValueError, match="cannot be merged into a quantized model"):
        model.merged("a")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_generate_the_engine_and_speculative_agree_on_a_quantized_model(quantized, kv_cache_dtype):
    """Greedy tokens of every driver (dense cache, paged engine, speculative verify) are one
    sequence; with the float cache they are HF's greedy on the twin (fp32 throughout)."""
    twin, base = quantized
    model = sj.Model(base.config, base.params, kv_cache_dtype=kv_cache_dtype)
    prompts = [random_prompt(7, 17), random_prompt(8, 9)]
    greedy = sj.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ours = [sj.generate(model, p, greedy).output_tokens for p in prompts]
    engine = sj.Engine(model, max_num_seqs=4, max_model_len=128)
    assert [r.output_tokens for r in engine.generate_many(prompts, greedy)] == ours
    speculative = sj.generate_speculative(model, prompts[0], greedy).output_tokens
    assert speculative == ours[0]
    if kv_cache_dtype == "auto":
        with torch.no_grad():
            out = twin.generate(torch.tensor([prompts[0]]), max_new_tokens=12, do_sample=False)
        assert out[0, len(prompts[0]) :].tolist() == ours[0]


def test_the_fp8_cache_stores_e4m3_and_reads_close_to_the_float_cache(tiny_llama):
    _, model = tiny_llama
    narrow = sj.Model(model.config, model.params, kv_cache_dtype="fp8")
    state = narrow.runner.init_state(2, 32)
    assert state.k[0].data.dtype == jnp.float8_e4m3fn
    assert state.nbytes < model.runner.init_state(2, 32).nbytes / 3  # fp32 model: 1 byte of 4
    ids = random_prompt(9, 30)
    ref, ours = model.logits(ids), narrow.logits(ids)
    assert not np.array_equal(ref, ours)  # the cache really is narrow
    assert np.abs(ours - ref).max() < 0.05 * np.abs(ref).max()
    with pytest.raises(ValueError, match="kv_cache_dtype 'int4' is not supported"):
        sj.Model(model.config, model.params, kv_cache_dtype="int4")
