"""Per-request LoRA adapters on a decoder against PEFT (fp32, tiny random models)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import HF_BUILDERS, add_peft_adapters, make_peft, model_from_hf, random_prompt

import spark_jax as sj
from spark_jax import engine
from spark_jax.lora import LoraAdapter, LoraPool, LoraTarget
from spark_jax.models import decoder

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name -> LoraConfig kwargs; B initialised non-zero (init_lora_weights=False)
    "all_r4": dict(r=4, lora_alpha=8, target_modules=ALL),
    "attn_r8_rslora": dict(r=8, lora_alpha=4, target_modules=ALL[:4], use_rslora=True),
    "mlp_r2": dict(r=2, lora_alpha=16, target_modules=ALL[4:]),
}


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    torch.manual_seed(3)
    hf = HF_BUILDERS["qwen2_bias"]().eval()
    model = model_from_hf(hf)
    model.enable_lora(max_adapters=4, max_rank=8)
    return hf, model, add_peft_adapters(model, hf, ADAPTERS, tmp_path_factory)


def test_each_adapter_matches_peft_and_base_rows_match_the_base_model(lora_setup):
    hf, model, peft_models = lora_setup
    ids = random_prompt(40, 17)
    with torch.no_grad():
        base_ref = hf(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_array_equal(model.logits(ids), model_from_hf(hf).logits(ids))
    assert np.abs(model.logits(ids) - base_ref).max() / np.abs(base_ref).max() <= 1e-4
    for name, peft_model in peft_models.items():
        with torch.no_grad():
            ref = peft_model(torch.tensor([ids])).logits[0].numpy()
        ours = model.logits(ids, adapter=name)
        assert np.abs(ref - base_ref).max() > 1e-3, f"{name} must change the model"
        rel = np.abs(ours - ref).max() / np.abs(ref).max()
        assert rel <= 1e-4, f"{name}: relative error {rel:.2e}"


def test_a_mixed_batch_gives_each_request_its_solo_result(lora_setup):
    _, model, _ = lora_setup
    names = [None, "all_r4", "attn_r8_rslora", "mlp_r2", "all_r4", None]
    prompts = [random_prompt(50 + i, 4 + 7 * i) for i in range(6)]
    params = [sj.SamplingParams(temperature=0.0, max_tokens=10, adapter=n) for n in names]
    solo = [sj.generate(model, p, sp).output_tokens for p, sp in zip(prompts, params, strict=True)]
    mixed = sj.generate_batch(model, prompts, params)
    assert [r.output_tokens for r in mixed] == solo
    assert len({tuple(s) for s in solo[1:4]}) == 3  # the adapters really differ
    plain = model_from_hf(lora_setup[0])
    base = sj.SamplingParams(temperature=0.0, max_tokens=10)
    assert solo[0] == sj.generate(plain, prompts[0], base).output_tokens


def test_changing_the_adapter_mix_never_recompiles(lora_setup):
    _, model, _ = lora_setup
    prompts = [random_prompt(60 + i, 5) for i in range(3)]

    def run(names):
        params = [sj.SamplingParams(temperature=0.0, max_tokens=3, adapter=n) for n in names]
        sj.generate_batch(model, prompts, params)

    run(["all_r4", None, "mlp_r2"])
    before = (decoder.prefill._cache_size(), engine._decode_chunk._cache_size())
    run(["mlp_r2", "attn_r8_rslora", "all_r4"])
    run([None, None, "attn_r8_rslora"])
    assert (decoder.prefill._cache_size(), engine._decode_chunk._cache_size()) == before


def _bf16(v) -> np.ndarray:
    return np.asarray(jnp.asarray(v, jnp.bfloat16), np.float32)


def test_a_bf16_delta_rounds_like_the_fp32_low_rank_product_and_is_zero_for_base_rows():
    rng = np.random.default_rng(5)
    d, f, r = 64, 48, 4
    pool = LoraPool({"m": LoraTarget(("lin",), 0, 1, d, 0, f, f)}, 3, 8, jnp.bfloat16)
    adapters = [
        LoraAdapter(
            f"a{i}", r, 0.5, {"m": (rng.standard_normal((r, d)), rng.standard_normal((f, r)))}
        )
        for i in range(3)
    ]
    for adapter in adapters:
        pool.add(adapter)
    rows = np.array([-1, 2, 0, 1, -1])
    x = jnp.asarray(rng.standard_normal((len(rows), 1, d)), jnp.bfloat16)
    delta = pool.batch(rows).scope("lin").delta(x)
    assert delta.dtype == jnp.bfloat16  # rounded inside the GEMM, no fp32 result to convert
    delta = np.asarray(delta[:, 0], np.float32)
    assert not delta[rows == -1].any()
    for row, slot in enumerate(rows):
        if slot >= 0:
            a, b = adapters[slot].weights["m"]
            h = _bf16(np.asarray(x[row, 0], np.float32) @ _bf16(a.T))
            np.testing.assert_allclose(delta[row], _bf16(h @ _bf16(b.T * 0.5)), rtol=2**-7)


def test_merged_adapter_equals_the_unmerged_output(lora_setup):
    _, model, _ = lora_setup
    ids = random_prompt(41, 12)
    merged = model.merged("all_r4")
    np.testing.assert_allclose(
        merged.logits(ids), model.logits(ids, adapter="all_r4"), rtol=1e-5, atol=1e-5
    )


def test_bad_adapters_are_refused_clearly_and_serving_goes_on(lora_setup, tmp_path):
    hf, model, _ = lora_setup
    from transformers import Qwen2Config, Qwen2ForCausalLM

    other = Qwen2ForCausalLM(Qwen2Config(**{**hf.config.to_dict(), "hidden_size": 32}))
    make_peft(other, 0, r=4, lora_alpha=8, target_modules=["q_proj"]).save_pretrained(
        tmp_path / "o"
    )
    with pytest.raises(ValueError, match="q_proj.*another base model"):
        model.add_adapter("other_base", tmp_path / "o")
    make_peft(hf, 0, r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True).save_pretrained(
        tmp_path / "dora"
    )
    with pytest.raises(ValueError, match="DoRA"):
        model.add_adapter("dora", tmp_path / "dora")
    make_peft(hf, 0, r=4, lora_alpha=8, target_modules=["lm_head"]).save_pretrained(
        tmp_path / "head"
    )
    with pytest.raises(ValueError, match="lm_head"):
        model.add_adapter("head", tmp_path / "head")
    with pytest.raises(ValueError, match="not loaded"):
        sj.generate(model, [1, 2, 3], sj.SamplingParams(adapter="nope"))
    assert model.slot_pool.in_use == 0
    ok = sj.generate(model, [1, 2, 3], sj.SamplingParams(temperature=0.0, adapter="mlp_r2"))
    assert len(ok.output_tokens) == 16
