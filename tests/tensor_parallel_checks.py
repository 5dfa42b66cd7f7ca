"""The tensor-parallel checks, run in child processes by tests/test_tensor_parallel.py.

JAX fixes its device count when it starts, so these run where the simulated CPU devices were
asked for before the import (``XLA_FLAGS=--xla_force_host_platform_device_count``): one
process with 8 devices (``single OUT``: every check, results to ``OUT/single.json``), or one of
two processes of a ``jax.distributed`` job on localhost with 2 devices each (``multi RANK PORT
CHECKPOINT OUT``: logits at TP = 4 to ``OUT/multi_RANK.npy``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

STARTED = time.perf_counter()

MODE = sys.argv[1]
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={8 if MODE == 'single' else 2}"
).strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402

if MODE == "multi":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    rank, port = int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)

import spark_jax as sj  # noqa: E402
from spark_jax.checkpoint import PARAMS_DIR, restore_params  # noqa: E402
from spark_jax.models import declare  # noqa: E402
from spark_jax.ops.sharding import (  # noqa: E402
    device_bytes,
    holds_full_copy,
    make_mesh,
    replicated,
)

PROMPT = [3, 17, 29, 5, 77, 1, 64, 90]
SHARDS = (2, 4, 8)
# Tiny decoders with 8 query heads over 2 KV heads: TP = 2 splits the KV heads, TP = 4 and 8
# copy them (each shard one KV head).
DECODER = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
)


def decoder_families() -> dict:
    import transformers as t

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
            "rope_theta": 10000.0}  # fmt: skip
    return {
        "llama": (t.LlamaForCausalLM, t.LlamaConfig(**DECODER, rope_parameters=rope)),
        "qwen2": (t.Qwen2ForCausalLM, t.Qwen2Config(**DECODER, tie_word_embeddings=False)),
        "qwen3": (t.Qwen3ForCausalLM, t.Qwen3Config(**DECODER, tie_word_embeddings=True)),
        "mistral": (t.MistralForCausalLM, t.MistralConfig(**DECODER, sliding_window=3)),
    }


def nllb_family():
    import transformers as t

    # 300 tokens: a vocabulary 8 does not divide, so at TP = 8 the table splits by model dim.
    config = t.M2M100Config(
        vocab_size=300, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64,
    )  # fmt: skip
    return t.M2M100ForConditionalGeneration, config


def converted(out: Path, name: str, model_class, config) -> Path:
    import torch

    from conversion.hf_to_orbax import convert

    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():  # biases and norms away from 0 and 1, so a misplaced one shows
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out / name / "hf")
    return convert(out / name / "hf", out / name / "converted", "float32", False)


def greedy_decoder(model: sj.Model) -> list[int]:
    return sj.generate(model, PROMPT, sj.SamplingParams(max_tokens=3, temperature=0)).output_tokens


def greedy_nllb(model: sj.Model, source: list[int]) -> list[int]:
    """Greedy continuation through teacher-forced logits (the tiny NLLB has no tokenizer)."""
    tokens = [2, 256]  # decoder start, a target "language"
    for _ in range(3):
        tokens.append(int(model.logits(source, tokens)[-1].argmax()))
    return tokens[2:]


def loading_holds_no_full_copy(path: Path, model: sj.Model) -> dict:
    """Every leaf ``model`` (loaded from ``path``) shards, at every stage of ``load_sharded``:
    the restored arrays, the reordered ones, the final ones; and the K/V cache."""
    shards = model.tensor_parallel
    sharded = {
        jax.tree_util.keystr(k)
        for k, leaf in jax.tree_util.tree_leaves_with_path(model.params)
        if any(axis is not None for axis in leaf.sharding.spec)
    }
    mesh = make_mesh(shards)
    plain = declare(sj.config_from_hf(json.loads((path / "config.json").read_text())))
    restored = restore_params(path / PARAMS_DIR, shardings=plain.load_shardings(mesh))
    # The reorder of each fused leaf, as shard_major runs it, before its move to columns.
    reordered = {}
    for p in plain.params:
        columns = p.shard_major_columns(shards)
        if columns is not None and p.path[-1] == "kernel":
            node = restored
            for key in p.path:
                node = node[key]
            reordered[str(p.path)] = jax.numpy.take(node, columns, axis=-1)
    stages = {"restored": restored, "reordered": reordered, "final": model.params}
    full_copies, largest_fraction = [], 0.0
    for stage, tree in stages.items():
        for key, leaf in jax.tree_util.tree_leaves_with_path(tree):
            name = jax.tree_util.keystr(key)
            if stage != "reordered" and name not in sharded:
                continue
            if leaf.ndim < 2:  # fused biases are reordered whole (vectors)
                continue
            fraction = max(device_bytes(leaf).values()) / leaf.nbytes
            largest_fraction = max(largest_fraction, fraction)
            if holds_full_copy(leaf):
                full_copies.append(f"{stage} {name}")
    cache = model.runner.init_state(2, 16)
    cache_specs = sorted({str(x.sharding.spec) for x in (*cache.k, *cache.v)})
    return {
        "sharded_leaves": len(sharded),
        "full_copies": full_copies,
        "largest_device_fraction": largest_fraction,
        "cache_specs": cache_specs,
        "cache_full_copies": [str(i) for i, x in enumerate(cache.k) if holds_full_copy(x)],
    }


def peft_adapter(out: Path, name: str, model_class, targets: list[str]) -> Path:
    """A PEFT adapter (B non-zero) of the converted model ``name``, saved under ``out``."""
    from helpers import make_peft

    hf = model_class.from_pretrained(out / name / "hf").eval()
    path = out / name / "adapter"
    make_peft(hf, 0, r=4, lora_alpha=8, target_modules=targets).save_pretrained(path)
    return path


def lora_check(path: Path, adapter: Path, *inputs: list[int]) -> dict:
    """An adapter's logits at TP = 2, 4, 8 against TP = 1 (max abs difference), and how far
    the adapter moves them from the base model's (so a dropped update would show)."""
    one = sj.load(path)
    one.add_adapter("a", adapter)
    reference = one.logits(*inputs, adapter="a")
    diffs = {"effect": float(np.abs(reference - one.logits(*inputs)).max())}
    for n in SHARDS:
        model = sj.load(path, tensor_parallel=n)
        model.add_adapter("a", adapter)
        diffs[str(n)] = float(np.abs(model.logits(*inputs, adapter="a") - reference).max())
    return diffs


def engine_check(path: Path, adapter: Path) -> dict:
    """A TP = 4 engine, warmed up, against each request alone at TP = 1; every other request
    under an adapter."""
    from helpers import CompileCounter

    one = sj.load(path)
    model = sj.load(path, tensor_parallel=4)
    for m in (one, model):
        m.add_adapter("a", adapter)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, 128, size=int(rng.randint(1, 30))).tolist() for _ in range(6)]
    params = [
        sj.SamplingParams(max_tokens=int(rng.randint(1, 6)), temperature=0.0 if i % 2 else 1.0,
                          seed=i, top_k=20 if i % 3 else -1, adapter="a" if i % 2 else None)
        for i in range(6)
    ]  # fmt: skip
    # 32 tokens: room for a chunk beside both rows, so the decode rows ride in the prefill
    # batches (mixed batches, the default where they fit).
    engine = sj.Engine(
        model, max_num_seqs=2, max_batch_tokens=32, page_size=16, max_model_len=64,
        decode_widths=[2],
    )  # fmt: skip
    engine.warmup(compile_threads=2)
    with CompileCounter() as counter:
        results = engine.generate_many(prompts, params)
    alone = [sj.generate(one, p, sp).output_tokens for p, sp in zip(prompts, params, strict=True)]
    return {
        "batch_invariant": [r.output_tokens for r in results] == alone,
        "compiles_after_warmup": counter.count,
        "pages_spec": str(engine.executor.state.k_pages[0].sharding.spec),
        "mixed_steps": engine.executor.num_mixed_steps,
    }


def speculative_check(path: Path) -> dict:
    """At TP = 4, greedy speculative outputs (a draft model laid out as the target, alone and
    in the engine; prompt lookup and a random draft head in the engine) against plain greedy
    at TP = 1."""
    from spark_jax.models import draft_head

    one = sj.load(path)
    model = sj.load(path, tensor_parallel=4)
    params = sj.SamplingParams(max_tokens=12, temperature=0.0)
    prompt = PROMPT * 3
    want = sj.generate(one, prompt, params).output_tokens
    alone = sj.generate_speculative(model, prompt, params, 3, "draft", draft_model=model)
    result = {"alone_draft": alone.output_tokens == want}
    try:  # a draft on one device cannot share the target's program
        sj.generate_speculative(model, prompt, params, 3, "draft", draft_model=one)
        result["other_layout_refused"] = ""
    except ValueError as error:
        result["other_layout_refused"] = str(error)
    head_config = draft_head.head_config(one.config, intermediate_size=32, num_heads=2)
    head = (draft_head.init_params(head_config, jax.random.PRNGKey(3)), head_config)
    methods = (("ngram", {}), ("draft", {"draft_model": model}), ("head", {"draft_head": head}))
    for method, extra in methods:
        config = {"method": method, "num_speculative_tokens": 3, **extra}
        engine = sj.Engine(
            model, max_num_seqs=2, max_batch_tokens=16, page_size=16, max_model_len=64,
            decode_widths=[2], speculative_config=config,
        )  # fmt: skip
        (out,) = engine.generate_many([prompt], [params])
        result[f"engine_{method}"] = out.output_tokens == want
        result[f"engine_{method}_accepted"] = engine.metrics().num_accepted_tokens
    return result


# Greedy runs compile a generation loop per layout: every TP size for Llama, one for the other
# families (their logits are checked at every size).
GREEDY_SHARDS = {"llama": SHARDS, "nllb": (8,)}
LOADING_CHECKS = {("llama", 4), ("qwen2", 8), ("nllb", 8)}


DECODER_LORA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NLLB_LORA = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


def single(out: Path) -> None:
    report: dict = {"logits": {}, "greedy": {}, "loading": {}, "seconds": {}, "lora": {}}
    report["seconds"]["imports"] = time.perf_counter() - STARTED
    paths = {}
    for name, (model_class, config) in decoder_families().items():
        paths[name] = path = converted(out, name, model_class, config)
        base = sj.load(path)
        reference, greedy = base.logits(PROMPT), greedy_decoder(base)
        if name == "llama":
            np.save(out / "llama_logits.npy", reference)
        report["logits"][name], report["greedy"][name] = {}, {"1": greedy}
        for n in SHARDS:
            model = sj.load(path, tensor_parallel=n)
            report["logits"][name][str(n)] = float(np.abs(model.logits(PROMPT) - reference).max())
            if n in GREEDY_SHARDS.get(name, (4,)):
                report["greedy"][name][str(n)] = greedy_decoder(model)
            if (name, n) in LOADING_CHECKS:
                report["loading"][f"{name}_tp{n}"] = loading_holds_no_full_copy(path, model)
        report["seconds"][name] = time.perf_counter() - STARTED
    paths["nllb"] = path = converted(out, "nllb", *nllb_family())
    source, decoder_ids = [256, 7, 99, 41, 12, 2], [2, 256, 18, 77]
    base = sj.load(path)
    reference = base.logits(source, decoder_ids)
    report["logits"]["nllb"], report["greedy"]["nllb"] = {}, {"1": greedy_nllb(base, source)}
    for n in SHARDS:
        model = sj.load(path, tensor_parallel=n)
        diff = np.abs(model.logits(source, decoder_ids) - reference).max()
        report["logits"]["nllb"][str(n)] = float(diff)
        if n in GREEDY_SHARDS["nllb"]:
            report["greedy"]["nllb"][str(n)] = greedy_nllb(model, source)
        if ("nllb", n) in LOADING_CHECKS:
            report["loading"][f"nllb_tp{n}"] = loading_holds_no_full_copy(path, model)
    report["seconds"]["nllb"] = time.perf_counter() - STARTED
    adapters = {
        "llama": peft_adapter(out, "llama", decoder_families()["llama"][0], DECODER_LORA),
        "nllb": peft_adapter(out, "nllb", nllb_family()[0], NLLB_LORA),
    }
    report["lora"]["llama"] = lora_check(paths["llama"], adapters["llama"], PROMPT)
    report["lora"]["nllb"] = lora_check(paths["nllb"], adapters["nllb"], source, decoder_ids)
    report["seconds"]["lora"] = time.perf_counter() - STARTED
    report["engine"] = engine_check(paths["llama"], adapters["llama"])
    report["speculative"] = speculative_check(paths["llama"])
    report["seconds"]["engine"] = time.perf_counter() - STARTED
    report["kernels"] = kernels_check()
    report["seconds"]["kernels"] = time.perf_counter() - STARTED
    print(json.dumps(report["seconds"]))
    (out / "single.json").write_text(json.dumps(report, indent=1))


def kernels_check() -> dict:
    """Our Triton kernels (interpreted) per shard under ``shard_map`` at TP = 4 against XLA's
    reference on one device: the one-query kernel's write-and-attend step over a dense MHA
    cache, and the fp8-cache kernel over dense and paged E4M3 caches. Max abs differences,
    and the sharding of the outputs. (The Mosaic kernels take minutes a call in the
    interpreter; they go through the same wrapper.)"""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from spark_jax.ops.attention import cache_attention, cache_step_attention
    from spark_jax.ops.kv_cache import PagedLayer, ScaledLayer, quantize_kv
    from spark_jax.ops.options import KernelOptions
    from spark_jax.ops.reference import AttentionMask

    mesh = make_mesh(4)
    heads = NamedSharding(mesh, PartitionSpec(None, None, "tp", None))
    by_head = NamedSharding(mesh, PartitionSpec("tp"))
    sharded = KernelOptions(implementation="pallas", mesh=mesh)
    plain = KernelOptions(implementation="xla")
    rng = np.random.RandomState(2)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    seen: dict = {}

    # One-query (MHA, 8 heads): the new key written at each row's length, then attended.
    b, s, n, h = 3, 32, 8, 16
    q, k, v, k_cache, v_cache = normal(b, 1, n, h), normal(b, 1, n, h), normal(b, 1, n, h), \
        normal(b, s, n, h), normal(b, s, n, h)  # fmt: skip
    lengths = jnp.asarray([5, 0, 31], jnp.int32)
    mask = AttentionMask(lengths[:, None], lengths + 1)
    want = cache_step_attention(q, k, v, k_cache, v_cache, None, lengths[:, None], mask,
                                options=plain)  # fmt: skip
    placed = [jax.device_put(x, heads) for x in (q, k, v, k_cache, v_cache)]
    got = cache_step_attention(*placed, None, lengths[:, None], mask, options=sharded)
    seen["one_query"] = max(float(jnp.abs(g - w).max()) for g, w in zip(got, want, strict=True))
    seen["one_query_spec"] = str(got[0].sharding.spec)

    # The fp8 cache (GQA, 8 query heads over 4 KV heads), dense then paged.
    q = normal(b, 1, 8, 64).astype(jnp.bfloat16)
    scales = [jnp.asarray(rng.uniform(0.5, 2.0, 4), jnp.bfloat16) for _ in range(2)]
    rows = [quantize_kv(normal(b, 64, 4, 64), sc) for sc in scales]
    lengths = jnp.asarray([64, 1, 40], jnp.int32)
    mask = AttentionMask(lengths[:, None] - 1, lengths)
    table = jnp.arange(b * 4, dtype=jnp.int32).reshape(b, 4)  # 4 pages of 16 keys per row
    for layout in ("dense", "paged"):
        if layout == "dense":
            caches = [ScaledLayer(r, sc) for r, sc in zip(rows, scales, strict=True)]
        else:
            caches = [PagedLayer(r.reshape(b * 4, 16, 4, 64), table, sc)
                      for r, sc in zip(rows, scales, strict=True)]  # fmt: skip
        want = cache_attention(q, *caches, None, mask, options=plain)
        placed = [
            jax.tree.map(lambda x: jax.device_put(x, heads if x.ndim == 4 else
                                                  by_head if x.ndim == 1 else replicated(mesh)), c)
            for c in caches
        ]  # fmt: skip
        got = cache_attention(jax.device_put(q, heads), *placed, None, mask, options=sharded)
        seen[f"fp8_{layout}"] = float(jnp.abs(got.astype(jnp.float32) - want).max())
    return seen


def multi(path: Path, out: Path) -> None:
    model = sj.load(path, tensor_parallel=4)  # 2 devices of each of the 2 processes
    logits = model.logits(PROMPT)
    np.save(out / f"multi_{jax.process_index()}.npy", logits)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    if MODE == "single":
        single(Path(sys.argv[2]))
    else:
        multi(Path(sys.argv[4]), Path(sys.argv[5]))
