"""Per-request LoRA adapters on a decoder against PEFT (fp32, tiny random models)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import HF_BUILDERS, add_peft_adapters, make_peft, model_from_hf, random_prompt

import spark_jax as sj
from spark_jax.generation import step
from spark_jax.models import decoder
from spark_jax.ops.lora import LoraAdapter, LoraPool, LoraTarget

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
    # Prefilled two rows a call (prompts pad to 64 positions), each group with its adapters.
    two_a_call = sj.LoopOptions(prefill_tokens_per_call=128)
    grouped = sj.generate_batch(model, prompts, params, loop=two_a_call)
    assert [r.output_tokens for r in grouped] == solo
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
    before = (decoder.prefill._cache_size(), step.chunk_loop._cache_size())
    run(["mlp_r2", "attn_r8_rslora", "all_r4"])
    run([None, None, "attn_r8_rslora"])
    assert (decoder.prefill._cache_size(), step.chunk_loop._cache_size()) == before


def _bf16(v) -> np.ndarray:
    return np.asarray(jnp.asarray(v, jnp.bfloat16), np.float32)


def test_a_bf16_delta_matches_the_fp32_low_rank_product_and_is_zero_for_base_rows():
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
    assert delta.dtype == jnp.float32  # x a rounds to bf16 in its GEMM, ·b's sum stays fp32
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


def test_adapter_a_fused_into_the_base_kernel_gives_the_pool_path_logits(lora_setup):
    """``fused_params`` + ``batch(fused=True)`` is the same math as the pool path, rewriting
    the fused columns after an adapter change follows the pool, and the trees given stay
    intact (``fuse_into``, for a caller owning its tree, builds the same kernels)."""
    hf, model, _ = lora_setup
    config = model.config
    targets = decoder.lora_targets(config)
    rng = np.random.default_rng(7)

    def adapter(name: str, rank: int) -> LoraAdapter:
        weights = {
            module: (rng.standard_normal((rank, t.in_dim)), rng.standard_normal((t.out_dim, rank)))
            for module, t in targets.items()
            if not module.endswith("k_proj")  # a module left out keeps its columns zero
        }
        return LoraAdapter(name, rank, 0.05, weights)

    pool = LoraPool(targets, max_adapters=3, max_rank=4)
    for name, rank in (("x", 4), ("y", 2), ("z", 3)):
        pool.add(adapter(name, rank))
    base = model_from_hf(hf).params
    tokens = jnp.asarray([random_prompt(70 + i, 8) for i in range(4)], jnp.int32)
    lengths = jnp.full((4,), 8, jnp.int32)

    def logits(params, lora):
        kv = decoder.init_cache(config, 4, 16, jnp.float32)
        return np.asarray(decoder.verify(params, config, tokens, lengths, kv, lora)[0])

    rows = np.array([2, -1, 0, 1])
    fused = pool.fused_params(base)
    assert base["layers_0"]["attn"]["qkv_proj"]["kernel"].shape[1] == config.qkv_size
    assert fused["embed_tokens"] is base["embed_tokens"]  # the unadapted leaves are shared
    np.testing.assert_allclose(
        logits(fused, pool.batch(rows, True)), logits(base, pool.batch(rows)), rtol=1e-5, atol=1e-5
    )
    pool.remove("y")
    pool.add(adapter("w", 4))
    before = np.asarray(logits(fused, pool.batch(rows, True)))
    fused = pool.fused_params(fused)  # rewrites the A columns, in new arrays
    owned = model_from_hf(hf).params
    pool.fuse_into(owned)
    for path in {t.path for t in targets.values()}:
        node, same = fused, owned
        for key in path:
            node, same = node[key], same[key]
        np.testing.assert_array_equal(node["kernel"], same["kernel"])
    width = pool.device_weights()["layers_0"]["attn"]["qkv_proj"]["a"].shape[1]
    assert fused["layers_0"]["attn"]["qkv_proj"]["kernel"].shape[1] == config.qkv_size + width
    adapted = logits(fused, pool.batch(rows, True))
    np.testing.assert_allclose(adapted, logits(base, pool.batch(rows)), rtol=1e-5, atol=1e-5)
    plain = logits(base, None)
    np.testing.assert_allclose(adapted[1], plain[1], rtol=1e-5, atol=1e-5)
    assert np.abs(adapted[[0, 2, 3]] - plain[[0, 2, 3]]).max() > 1e-2
    # No adapter input: a widened kernel's A columns are dropped from the output.
    np.testing.assert_array_equal(logits(fused, None), plain)
    with pytest.raises(ValueError, match="fuse the params first"):
        logits(base, pool.batch(rows, True))
    assert np.abs(before - adapted).max() > 1e-3  # the first fused tree kept its A's


def test_the_engine_steps_fused_kernels_and_adapter_changes_never_recompile(lora_setup, tmp_path):
    """With adapters resident the steps run [W | A] kernels (x W and x A from one GEMM) and
    give each request its solo result; warm-up compiles the steps with and without adapter rows,
    and swapping an adapter after it only rewrites the A columns (new params, same shapes):
    nothing compiles."""
    from helpers import CompileCounter

    from spark_jax.serving.engine import Engine

    _, model, peft_models = lora_setup
    runner = model.runner
    engine = Engine(model, max_num_seqs=4, max_batch_tokens=64, page_size=16, max_model_len=64)
    engine.warmup()
    pool_a = runner.lora_pool.device_weights()["layers_0"]["attn"]["qkv_proj"]["a"]
    fused = runner.params["layers_0"]["attn"]["qkv_proj"]["kernel"]
    assert runner.params is model.params
    assert fused.shape[1] == model.config.qkv_size + pool_a.shape[1]

    names = ["mlp_r2", None, "all_r4", "attn_r8_rslora"]
    prompts = [random_prompt(300 + i, 5 + 4 * i) for i in range(4)]
    params = [
        sj.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, adapter=n) for n in names
    ]
    peft_models["mlp_r2"].save_pretrained(tmp_path / "mlp_r2")

    def swap_and_serve() -> list[list[int]]:
        model.remove_adapter("mlp_r2")
        model.add_adapter("mlp_r2", tmp_path / "mlp_r2")
        return [r.output_tokens for r in engine.generate_many(prompts, params)]

    with CompileCounter() as counter:  # warm-up compiled the adapter and base-only steps
        first = swap_and_serve()
        again = swap_and_serve()
        only_base = [r.output_tokens for r in engine.generate_many(prompts[1:2], params[1:2])]
    assert counter.count == 0
    solo = [sj.generate(model, p, sp).output_tokens for p, sp in zip(prompts, params, strict=True)]
    assert first == again == solo
    assert only_base == [solo[1]]


def _adapted_kernels(model: sj.Model) -> dict:
    """Every kernel of ``model.params`` an adapter can target, by its params path."""
    paths = {t.path for t in decoder.lora_targets(model.config).values()}
    return {path: model.params[path[0]][path[1]][path[2]]["kernel"] for path in paths}


@pytest.fixture
def fresh_model(lora_setup, tmp_path):
    """A new model of lora_setup's weights with no pool, and a PEFT adapter saved to disk."""
    hf, _, peft_models = lora_setup
    peft_models["all_r4"].save_pretrained(tmp_path / "all_r4")
    return hf, model_from_hf(hf), tmp_path / "all_r4"


def test_adapter_changes_build_new_params_and_leave_the_old_intact(fresh_model):
    """Adding an adapter sets new params (adapted kernels widened to [W | A], every other leaf
    shared); the tree taken before stays valid with its values, through generation too; steps
    never change ``model.params``; never narrowed again; base-only generation after removing
    every adapter gives the plain model's tokens."""
    hf, model, adapter_dir = fresh_model
    prompts = [random_prompt(500 + i, 6 + 3 * i) for i in range(3)]
    greedy = sj.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain_tokens = [r.output_tokens for r in sj.generate_batch(model, prompts, greedy)]
    held = model.params
    plain = _adapted_kernels(model)
    values = {path: np.asarray(kernel).copy() for path, kernel in plain.items()}
    plain_logits = model.logits(prompts[1])

    def check_held_intact() -> None:
        for path, kernel in plain.items():
            assert held[path[0]][path[1]][path[2]]["kernel"] is kernel, path
            assert not kernel.is_deleted(), path
            np.testing.assert_array_equal(np.asarray(kernel), values[path])
        np.testing.assert_array_equal(sj.Model(model.config, held).logits(prompts[1]), plain_logits)

    model.add_adapter("a", adapter_dir)
    assert model.params is not held and model.runner.params is model.params
    check_held_intact()
    fused = _adapted_kernels(model)
    for path, kernel in plain.items():
        assert fused[path].shape[0] == kernel.shape[0]
        assert fused[path].shape[1] > kernel.shape[1], path
    assert model.params["embed_tokens"] is held["embed_tokens"]  # nothing else is copied

    adapted_params, leaves = model.params, jax.tree_util.tree_leaves(model.params)
    adapted = sj.generate(model, prompts[0], dataclasses.replace(greedy, adapter="a"))
    base_too = sj.generate_batch(model, prompts, greedy)  # base rows on the widened kernels
    assert model.params is adapted_params and model.runner.params is adapted_params
    after = jax.tree_util.tree_leaves(model.params)
    assert len(after) == len(leaves) and all(x is y for x, y in zip(after, leaves, strict=True))
    assert not any(leaf.is_deleted() for leaf in after)
    check_held_intact()
    assert adapted.output_tokens != plain_tokens[0]
    assert [r.output_tokens for r in base_too] == plain_tokens

    model.remove_adapter("a")
    again = [r.output_tokens for r in sj.generate_batch(model, prompts, greedy)]
    assert again == plain_tokens
    still = _adapted_kernels(model)
    for path, kernel in fused.items():
        assert still[path].shape == kernel.shape, path  # never un-fused: zero A columns
        assert not kernel.is_deleted(), path  # the adapted tree, too, was left as it was
    np.testing.assert_array_equal(model.logits(prompts[1]), model_from_hf(hf).logits(prompts[1]))
    check_held_intact()


def test_merged_and_speculative_drafts_work_from_an_adapted_model(fresh_model):
    """``merged`` gives plain kernels from fused ones; a layer-skip draft built before the
    adapter (on the plain tree it took) or after it (on the widened kernels) and plain target
    steps run with no adapter input."""
    from spark_jax.generation.speculative import LayerSkipDrafter, generate_speculative

    hf, model, adapter_dir = fresh_model
    prompt = random_prompt(600, 9)
    greedy = sj.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    early = LayerSkipDrafter(model, skip=[1])  # built before the kernels are widened
    reference = sj.generate(model, prompt, greedy).output_tokens
    model.add_adapter("a", adapter_dir)
    with_adapter = dataclasses.replace(greedy, adapter="a")
    adapted = sj.generate(model, prompt, with_adapter).output_tokens

    merged = model.merged("a")
    plain = _adapted_kernels(model_from_hf(hf))
    for path, kernel in _adapted_kernels(merged).items():
        assert kernel.shape == plain[path].shape, path
    assert sj.generate(merged, prompt, greedy).output_tokens == adapted

    for drafter in (early, LayerSkipDrafter(model, skip=[0])):
        result = generate_speculative(model, prompt, greedy, 3, drafter)
        assert result.output_tokens == reference
