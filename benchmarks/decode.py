"""Decode and prefill speed of the decoder on Llama-3-8B shapes, against the hardware floors.

    PYTHONPATH=. python3 benchmarks/decode.py            # on the H200: every mode, ~3 minutes
    PYTHONPATH=. python3 benchmarks/decode.py --tiny     # a tiny config on any backend (CI smoke)

Random bf16 weights (``decoder.init_params``). Every figure is set against its floor:
decode against bytes / bandwidth (weights read once per step, the embedding table excluded
since a step reads B rows of it, plus every row's valid K/V), prefill against FLOPs / the
bf16 matmul rate; both ceilings are measured in the same run (``benchmarks/common.py``), and
the floors are also given at DESIGN.md's 4.3 TB/s. Decode timings start from a cache whose
lengths are set directly with random K/V (``random_cache``): a decode step costs the same
whatever the keys hold, and a 4000-token prefill per configuration would only add compiles.

Modes (all by default): ``peer`` HF transformers (torch, same GPU, eager and sdpa, in a
process of its own so JAX and torch never share GPU memory), ``check`` greedy tokens of the
engine against recomputed logits (tiny fp32 model on the device) and finite logits,
``bs1`` the decode step at context 4k with its compile time and HLO report, ``engine``
``spark_jax.generation.generate.generate`` end to end, ``batch`` bs 8/32/64/128 at context 2k,
``prefill`` 4 x 2048 tokens, ``micro`` decode attention alone per implementation, and
``variants`` the whole decode step with the changes proposed in proposed_patch.diff, and
``flags`` bs=1 and bs=64 again in a child process under ALTERNATIVE_XLA_FLAGS. ``--tiny`` runs
in fp32 (the CPU backend has no bf16 batched dot), so its floor fractions mean nothing.
Results: one JSON line on stdout (and $OUT/decode.json), a table, $OUT/decode_tok_s.png.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    HBM_BYTES_PER_S,
    add_flash_prefill_flag,
    chain_seconds,
    copy_bandwidth,
    emit,
    floor_seconds,
    matmul_rate,
    median_seconds,
    out_dir,
    print_table,
    read_bandwidth,
    timed,
    torch_median_seconds,
)
from benchmarks.shapes import LLAMA3_8B, TINY, hf_llama_kwargs
from spark_jax.config import ModelConfig
from spark_jax.generation.generate import generate
from spark_jax.model import Model
from spark_jax.models import decoder
from spark_jax.ops import attention
from spark_jax.ops.attention import AttentionMask, reference_attention, split_kv_attention
from spark_jax.ops.kv_cache import KVCache, read_rows
from spark_jax.ops.sampling import SamplingParams

MODES = ("peer", "check", "bs1", "engine", "batch", "prefill", "micro", "variants", "flags")
SAVED_HLO = ("bs1", "bs64", "heads_major_bs64")  # $OUT takes 8 files at most
# The flags mode reruns bs1 and bs64 in a child process with these XLA flags.
ALTERNATIVE_XLA_FLAGS = "--xla_gpu_enable_triton_gemm=false"


@dataclass(frozen=True)
class Plan:
    """The sizes of one run."""

    config: ModelConfig
    bs1_context: int = 4096  # cache length of the bs=1 decode (and of the engine run)
    bs1_length: int = 4000  # valid keys per row when timing starts
    batch_context: int = 2048
    batch_sizes: tuple[int, ...] = (8, 32, 64, 128)
    decode_steps: int = 16  # timed steps per repeat (3 repeats)
    prefill_batch: int = 4
    prefill_len: int = 2048
    engine_new_tokens: int = 128
    micro_layers: int = 8  # distinct layer buffers per attention micro-benchmark call
    heads_major_batches: tuple[int, ...] = (64, 1)  # batch sizes of the variants stage
    cudnn_batches: tuple[int, ...] = (64,)
    hf_bs1_prompt: int = 4000
    hf_batch: int = 64
    hf_batch_prompt: int = 512
    hf_steps: int = 20
    matmul_n: int = 8192
    copy_bytes: int = 4 << 30
    dtype: str = "bfloat16"  # weights, activations and cache

    @property
    def itemsize(self) -> int:
        return jnp.dtype(self.dtype).itemsize


FULL = Plan(LLAMA3_8B)
SMALL = Plan(
    TINY,
    bs1_context=256,
    bs1_length=150,
    batch_context=128,
    batch_sizes=(2, 4),
    decode_steps=4,
    prefill_batch=2,
    prefill_len=64,
    engine_new_tokens=16,
    micro_layers=2,
    heads_major_batches=(4, 1),
    cudnn_batches=(4,),
    hf_bs1_prompt=100,
    hf_batch=4,
    hf_batch_prompt=32,
    hf_steps=4,
    matmul_n=256,
    copy_bytes=16 << 20,
    dtype="float32",  # the CPU backend has no bf16 x bf16 -> f32 batched dot
)


# ---------------------------------------------------------------------------------------------
# Byte and FLOP counts.


def weight_bytes_per_step(config: ModelConfig, itemsize: int = 2) -> int:
    """Weights a decode step reads: all but the embedding table (it gathers B rows of it)."""
    return (config.num_params - config.vocab_size * config.hidden_size) * itemsize


def kv_bytes_per_token(config: ModelConfig, itemsize: int = 2) -> int:
    """K and V of one position over all layers."""
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * itemsize


def prefill_flops(config: ModelConfig, batch: int, length: int) -> float:
    """Matmul FLOPs of a causal prefill: projections of every token, causal attention, and
    the LM head of the last token of each row."""
    d, f = config.hidden_size, config.intermediate_size
    per_token = config.num_layers * 2 * (d * config.qkv_size + config.q_size * d + 3 * d * f)
    attention = config.num_layers * batch * 2 * length * length * config.q_size  # QK + PV, half
    return per_token * batch * length + attention + 2 * batch * d * config.vocab_size


def decode_floor(config: ModelConfig, batch: int, length: int, bytes_per_s: float) -> float:
    nbytes = weight_bytes_per_step(config) + batch * length * kv_bytes_per_token(config)
    return floor_seconds(nbytes, bytes_per_s)


# ---------------------------------------------------------------------------------------------
# Inputs.


def random_cache(plan: Plan, batch: int, max_len: int, length: int, seed: int) -> KVCache:
    """A cache of ``batch`` rows holding ``length`` random keys and values each."""

    config = plan.config
    shape = (batch, max_len, config.num_kv_heads, config.head_dim)
    keys = jax.random.split(jax.random.key(seed), 2 * config.num_layers)
    layers = [jax.random.normal(k, shape, plan.dtype) for k in keys]
    return KVCache(
        k=tuple(layers[: config.num_layers]),
        v=tuple(layers[config.num_layers :]),
        lengths=jnp.full((batch,), length, jnp.int32),
    )


def random_tokens(config: ModelConfig, shape: tuple[int, ...], seed: int) -> Any:

    return jnp.asarray(np.random.default_rng(seed).integers(0, config.vocab_size, shape), jnp.int32)


# ---------------------------------------------------------------------------------------------
# The compiled step, read without running it.

_SHAPE = re.compile(r"=\s+(\w+)\[([\d,]*)\]\S*\s+([\w\-]+)\(")
_NOT_KERNELS = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "iota"}


def hlo_report(text: str, cache_elements: int) -> dict[str, Any]:
    """What the optimized HLO of a decode step does with the cache.

    Counts the entry computation's kernels (fusions, custom calls, copies: one launch each),
    the donated outputs aliased to inputs, and every entry instruction whose result has as
    many elements as one layer's K or V buffer: a copy or transpose of the cache shows here.
    """
    entry = text[text.index("\nENTRY ") :]
    entry = entry[: entry.index("\n}")]
    kernels: dict[str, int] = {}
    cache_sized: dict[str, int] = {}
    for line in entry.splitlines():
        match = _SHAPE.search(line)
        if not match:
            continue
        _, dims, opcode = match.groups()
        if opcode not in _NOT_KERNELS:
            kernels[opcode] = kernels.get(opcode, 0) + 1
        elements = int(np.prod([int(d) for d in dims.split(",")])) if dims else 1
        if elements == cache_elements and opcode not in ("parameter", "bitcast"):
            kind = re.search(r"kind=(\w+)", line)
            calls = re.search(r"calls=%?([\w.\-]+)", line)
            name = opcode + (f":{kind.group(1)}" if kind else "")
            if calls:
                name += ":" + _root_opcode(text, calls.group(1))
            cache_sized[name] = cache_sized.get(name, 0) + 1
    header = text[: text.index("\n")]
    targets = re.findall(r'custom_call_target="([^"]+)"', entry)
    return {
        "kernels": sum(kernels.values()),
        "kernels_by_opcode": kernels,
        "custom_call_targets": {t: targets.count(t) for t in sorted(set(targets))},
        "aliased_outputs": header.count("may-alias") + header.count("must-alias"),
        "cache_sized_results": cache_sized,
        "module_copies": len(re.findall(r"\bcopy\(", text)),
        "module_transposes": len(re.findall(r"\btranspose\(", text)),
    }


def _root_opcode(text: str, computation: str) -> str:
    start = re.search(rf"\n%?{re.escape(computation)}\s.*\{{\n", text)
    if start is None:
        return "?"
    body = text[start.end() : text.index("\n}", start.end())]
    root = re.search(r"ROOT .*?=\s+\S+\s+([\w\-]+)\(", body)
    return root.group(1) if root else "?"


def save_hlo(text: str, name: str) -> None:
    out = out_dir()
    if out is not None and name.removeprefix("hlo_decode_") in SAVED_HLO:
        with gzip.open(out / f"{name}.txt.gz", "wt") as f:
            f.write(text)


# ---------------------------------------------------------------------------------------------
# Experiments behind benchmarks/proposed_patch.diff: K/V stored heads-major [B, K, S, H], so
# both attention einsums are batched over (B, K) with those axes outermost and no operand of
# either needs a transpose; and cuDNN's attention for the one-query decode case.


def write_kv_heads_major(cache_layer: Any, new: Any, slots: Any, positions: Any) -> Any:
    """``write_kv`` for a [B, K, S, H] buffer: new [B, T, K, H] at positions [B, T]."""

    rows = jnp.arange(cache_layer.shape[0])[:, None] if slots is None else slots[:, None]
    return cache_layer.at[rows, :, positions].set(new.astype(cache_layer.dtype), mode="drop")


def attention_heads_major(q, k, v, mask, sliding_window=None, scale=None):
    """``reference_attention`` with k, v [B, K, S, H]."""

    b, t, n, h = q.shape
    kv_heads = k.shape[1]
    scale = h**-0.5 if scale is None else scale
    qg = q.reshape(b, t, kv_heads, n // kv_heads, h)
    scores = jnp.einsum("btkgh,bksh->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    visible = mask.dense(k.shape[2], sliding_window)[:, None, None, :, :]
    probs = jax.nn.softmax(jnp.where(visible, scores, -1e30), axis=-1)
    out = jnp.einsum(
        "bkgts,bksh->btkgh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    return out.reshape(b, t, n, h).astype(q.dtype)


def attention_cudnn_decode(q, k, v, mask, sliding_window=None, scale=None):
    """One query per row at the row's last position: only the key lengths matter."""

    del sliding_window
    return jax.nn.dot_product_attention(
        q, k, v, scale=scale, key_value_seq_lengths=mask.key_lengths, implementation="cudnn"
    )


@contextlib.contextmanager
def patched_decoder(write_kv: Callable | None, attention: Callable | None) -> Iterator[None]:
    """Traces the decoder with other cache-write / attention functions (variants).

    The decoder attends over its cache through ``cache_attention``; a variant's attention gets
    the rows read out (``read_rows``), as the committed path does off the paged GPU route.
    """

    def over_cache(q, k_cache, v_cache, slots, mask, sliding_window=None):
        keys, values = read_rows(k_cache, slots), read_rows(v_cache, slots)
        return attention(q, keys, values, mask, sliding_window)

    saved = decoder.write_kv, decoder.attention, decoder.cache_attention
    decoder.write_kv = write_kv or saved[0]
    decoder.attention = attention or saved[1]
    decoder.cache_attention = over_cache if attention else saved[2]
    try:
        yield
    finally:
        decoder.write_kv, decoder.attention, decoder.cache_attention = saved


def _variant_plan(text: str) -> dict[str, tuple[int, ...]]:
    """'name=1,8;other=64' -> {name: (1, 8), other: (64,)}; names from VARIANT_PATCHES."""
    plan = {}
    for item in text.split(";"):
        name, _, batches = item.partition("=")
        if name not in VARIANT_PATCHES:
            raise SystemExit(f"unknown variant {name!r}; known: {sorted(VARIANT_PATCHES)}")
        plan[name] = tuple(int(b) for b in batches.split(",") if b)
    return plan


def _fresh_decode_step() -> Callable:
    """The decode step as a new function object: a jit of it keeps a trace cache of its own."""

    def step(params, config, tokens, active, kv):
        return decoder.decode.__wrapped__(params, config, tokens, active, kv)

    return jax.jit(step, static_argnames=("config",), donate_argnames=("kv",))


# One jit per variant, each traced under its patch (a shared function would share traces).
VARIANT_NAMES = (
    "heads_major",
    "cudnn",
    "xla",
    "split_kv",
    "split_kv512",
    "split_kv128",
)
VARIANT_STEPS = {name: _fresh_decode_step() for name in VARIANT_NAMES}
greedy = jax.jit(lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32))


VARIANT_PATCHES = {
    "heads_major": (write_kv_heads_major, attention_heads_major),
    "cudnn": (None, attention_cudnn_decode),
    "xla": (None, reference_attention),
    "split_kv": (None, split_kv_attention),
    "split_kv512": (None, partial(split_kv_attention, chunk=512)),
    "split_kv128": (None, partial(split_kv_attention, chunk=128)),
}


# ---------------------------------------------------------------------------------------------
# Stages. Each returns a dict for the JSON line.


def stage_check(seed: int = 0) -> dict[str, Any]:
    """Greedy tokens of the engine equal the argmax of recomputed full-sequence logits."""

    with jax.default_matmul_precision("highest"):
        params = decoder.init_params(TINY, jax.random.key(seed), jnp.float32)
        params = jax.tree_util.tree_map(lambda x: x * 10.0, params)  # well-separated logits
        model = Model(TINY, params)
        prompt = [int(t) for t in np.random.default_rng(seed).integers(0, TINY.vocab_size, 11)]
        result = generate(model, prompt, SamplingParams(temperature=0.0, max_tokens=8))
        sequence, reference = list(prompt), []
        for _ in range(8):
            token = int(np.argmax(model.logits(sequence)[-1]))
            reference.append(token)
            sequence.append(token)
    return {"greedy_equal": result.output_tokens == reference, "tokens": result.output_tokens}


def stage_decode(
    plan: Plan, params: Any, batch: int, max_len: int, length: int, bw: float, tag: str
) -> dict[str, Any]:
    """The decode step: compile time, HLO report, ms per step alone and with greedy picking."""

    config = plan.config
    kv = random_cache(plan, batch, max_len, length, seed=batch)
    tokens = random_tokens(config, (batch,), seed=batch)
    active = jnp.ones((batch,), bool)
    start = time.perf_counter()
    lowered = decoder.decode.lower(params, config, tokens, active, kv)
    lower_s = time.perf_counter() - start
    compiled, compile_s = timed(lowered.compile)
    text = compiled.as_text()
    save_hlo(text, f"hlo_decode_{tag}")
    report = hlo_report(text, batch * max_len * config.num_kv_heads * config.head_dim)
    (logits, kv), first_call_s = timed(partial(decoder.decode, params, config, tokens, active, kv))
    finite = bool(jnp.all(jnp.isfinite(logits)))

    def restart() -> jax.Array:  # a new array each time: the step donates the lengths too
        return jnp.full((batch,), length, jnp.int32)

    def step(state):
        return decoder.decode(params, config, tokens, active, state)[1]

    step_s, step_all, kv = chain_seconds(step, kv.with_lengths(restart()), plan.decode_steps)

    def step_greedy(state):
        toks, cache = state
        logits, cache = decoder.decode(params, config, toks, active, cache)
        return greedy(logits), cache

    greedy_s, _, (_, kv) = chain_seconds(
        step_greedy, (tokens, kv.with_lengths(restart())), plan.decode_steps
    )
    floor_measured = decode_floor(config, batch, length, bw)
    floor_nominal = decode_floor(config, batch, length, HBM_BYTES_PER_S)
    return {
        "batch": batch,
        "max_len": max_len,
        "length": length,
        "lower_s": lower_s,
        "compile_s": compile_s,
        "first_call_after_compile_s": first_call_s,
        "ms_step": step_s * 1e3,
        "ms_step_repeats": [s * 1e3 for s in step_all],
        "ms_step_greedy": greedy_s * 1e3,
        "tok_s": batch / step_s,
        "tok_s_greedy": batch / greedy_s,
        "floor_ms": floor_nominal * 1e3,
        "floor_ms_measured_bw": floor_measured * 1e3,
        "frac_floor": floor_nominal / step_s,
        "frac_floor_measured_bw": floor_measured / step_s,
        "achieved_bytes_per_s": floor_nominal * HBM_BYTES_PER_S / step_s,
        "logits_finite": finite,
        "hlo": report,
    }


def stage_engine(plan: Plan, params: Any) -> dict[str, Any]:
    """``sj.generate``, greedy, ignore_eos: twice (cold with compiles, warm)."""

    config = plan.config
    model = Model(config, params, max_num_seqs=4)
    new = plan.engine_new_tokens
    prompt_len = plan.bs1_context - new  # cache_len(prompt + new) == bs1_context: shared compile
    prompt = [int(t) for t in np.random.default_rng(7).integers(0, config.vocab_size, prompt_len)]
    sampling = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    runs = []
    for _ in range(2):
        start = time.perf_counter()
        result = generate(model, prompt, sampling)
        wall = time.perf_counter() - start
        t = result.timings
        decode_s = t["total_s"] - t["ttft_s"]
        runs.append(
            {
                "wall_s": wall,
                "ttft_s": t["ttft_s"],
                "decode_tok_s": (len(result.output_tokens) - 1) / decode_s,
                "ms_token": decode_s / (len(result.output_tokens) - 1) * 1e3,
                "tokens": len(result.output_tokens),
            }
        )
    return {"prompt_len": prompt_len, "new_tokens": new, "cold": runs[0], "warm": runs[1]}


def stage_prefill(plan: Plan, params: Any, flop_rate: float) -> dict[str, Any]:
    """One prefill of ``prefill_batch`` rows of ``prefill_len`` tokens into an empty cache."""

    config, b, t = plan.config, plan.prefill_batch, plan.prefill_len
    kv = decoder.init_cache(config, b, t, plan.dtype)
    tokens = random_tokens(config, (b, t), seed=3)
    lengths = jnp.full((b,), t, jnp.int32)
    slots = jnp.arange(b, dtype=jnp.int32)
    (logits, kv), first_s = timed(
        lambda: decoder.prefill(params, config, tokens, lengths, slots, kv)
    )
    finite = bool(jnp.all(jnp.isfinite(logits)))
    state = {"kv": kv}

    def run():
        logits, state["kv"] = decoder.prefill(
            params, config, tokens, lengths, slots, state["kv"].with_lengths(jnp.zeros_like(slots))
        )
        return logits

    seconds = median_seconds(run, warmup=1, iters=5)
    flops = prefill_flops(config, b, t)
    return {
        "batch": b,
        "length": t,
        "first_call_s": first_s,
        "ms": seconds * 1e3,
        "tflop_s": flops / seconds / 1e12,
        "frac_matmul": flops / seconds / flop_rate,
        "tok_s": b * t / seconds,
        "logits_finite": finite,
    }


@partial(jax.jit, static_argnames=("fn",))
def attend_layers(fn: Callable, qs: list, ks: list, vs: list, mask: AttentionMask) -> list:
    """``fn`` over several layers' buffers in one program, as the decode step runs them."""
    return [fn(q, k, v, mask) for q, k, v in zip(qs, ks, vs, strict=True)]


def stage_micro(plan: Plan, bw: float) -> list[dict[str, Any]]:
    """Decode attention alone over ``micro_layers`` layers' buffers, per implementation."""
    c = plan.config
    impls = {
        "xla_bskh": (reference_attention, False),
        "xla_bksh": (attention_heads_major, True),
        "cudnn_bskh": (attention_cudnn_decode, False),
    }
    cases = [(1, plan.bs1_context, plan.bs1_length)]
    cases += [(b, plan.batch_context, plan.batch_context - 64) for b in plan.batch_sizes]
    rows = []
    n = plan.micro_layers
    for batch, max_len, length in cases:
        keys = jax.random.split(jax.random.key(batch), 3 * n)
        shape = (batch, max_len, c.num_kv_heads, c.head_dim)
        ks = [jax.random.normal(k, shape, plan.dtype) for k in keys[:n]]
        vs = [jax.random.normal(k, shape, plan.dtype) for k in keys[n : 2 * n]]
        q_shape = (batch, 1, c.num_heads, c.head_dim)
        qs = [jax.random.normal(k, q_shape, plan.dtype) for k in keys[2 * n :]]
        lengths = jnp.full((batch,), length, jnp.int32)
        mask = AttentionMask(query_positions=(lengths - 1)[:, None], key_lengths=lengths)
        nbytes = n * 2 * batch * length * c.num_kv_heads * c.head_dim * 2
        reference = reference_attention(qs[0], ks[0], vs[0], mask).astype(jnp.float32)
        for name, (fn, heads_major) in impls.items():
            row: dict[str, Any] = {"impl": name, "batch": batch, "length": length}
            try:
                row |= _time_attention(fn, qs, ks, vs, mask, heads_major, reference)
                row["us_per_layer"] = row.pop("seconds") / n * 1e6
                row["bytes_per_s"] = nbytes / (row["us_per_layer"] * n / 1e6)
                row["frac_bw"] = row["bytes_per_s"] / bw
            except Exception as exc:  # a variant that does not apply is a reading too
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
    return rows


def _time_attention(fn, qs, ks, vs, mask, heads_major: bool, reference) -> dict[str, float]:
    if heads_major:
        ks = [jnp.swapaxes(x, 1, 2) for x in ks]
        vs = [jnp.swapaxes(x, 1, 2) for x in vs]
    seconds = median_seconds(lambda: attend_layers(fn, qs, ks, vs, mask), iters=20)
    out = attend_layers(fn, qs, ks, vs, mask)[0].astype(jnp.float32)
    err = jnp.linalg.norm(out - reference) / jnp.linalg.norm(reference)
    return {"seconds": seconds, "rel_err": float(err)}


def stage_variant(
    plan: Plan, params: Any, name: str, batch: int, max_len: int, length: int, bw: float
) -> dict[str, Any]:
    """The whole decode step traced with a variant; its logits against the plain step's."""

    config = plan.config
    kv = random_cache(plan, batch, max_len, length, seed=100 + batch)
    tokens = random_tokens(config, (batch,), seed=5)
    active = jnp.ones((batch,), bool)
    heads_major = name == "heads_major"
    kv_variant = kv
    if heads_major:
        kv_variant = dataclasses.replace(
            kv,
            k=tuple(jnp.swapaxes(x, 1, 2) for x in kv.k),
            v=tuple(jnp.swapaxes(x, 1, 2) for x in kv.v),
            lengths=kv.lengths + 0,
        )
    else:
        kv_variant = jax.tree_util.tree_map(lambda x: x + 0, kv)
    plain_logits, kv = decoder.decode(params, config, tokens, active, kv)
    plain_logits = np.asarray(plain_logits)
    del kv
    step_fn = VARIANT_STEPS[name]
    with patched_decoder(*VARIANT_PATCHES[name]):
        lowered = step_fn.lower(params, config, tokens, active, kv_variant)
    compiled, compile_s = timed(lowered.compile)
    text = compiled.as_text()
    save_hlo(text, f"hlo_decode_{name}_bs{batch}")
    elements = batch * max_len * config.num_kv_heads * config.head_dim
    logits, kv_variant = compiled(params, tokens, active, kv_variant)
    logits = np.asarray(logits)
    err = np.linalg.norm(logits - plain_logits) / np.linalg.norm(plain_logits)
    same_argmax = float(np.mean(logits.argmax(-1) == plain_logits.argmax(-1)))

    def step(state):
        return compiled(params, tokens, active, state)[1]

    restart = jnp.full((batch,), length, jnp.int32)
    step_s, step_all, kv_variant = chain_seconds(
        step, kv_variant.with_lengths(restart), plan.decode_steps
    )
    del kv_variant
    floor = decode_floor(config, batch, length, HBM_BYTES_PER_S)
    return {
        "variant": name,
        "batch": batch,
        "max_len": max_len,
        "length": length,
        "compile_s": compile_s,
        "ms_step": step_s * 1e3,
        "ms_step_repeats": [s * 1e3 for s in step_all],
        "tok_s": batch / step_s,
        "frac_floor": floor / step_s,
        "frac_floor_measured_bw": decode_floor(config, batch, length, bw) / step_s,
        "logits_rel_err_vs_plain": float(err),
        "argmax_agreement_vs_plain": same_argmax,
        "hlo": hlo_report(text, elements),
    }


def stage_warm_start(plan: Plan, params: Any) -> dict[str, float]:
    """Trace + compile of the bs=1 decode step again with the in-memory caches cleared: the
    cold start of a server whose persistent compilation cache already holds the step."""
    jax.clear_caches()
    kv = random_cache(plan, 1, plan.bs1_context, plan.bs1_length, seed=11)
    tokens = random_tokens(plan.config, (1,), seed=11)
    active = jnp.ones((1,), bool)
    start = time.perf_counter()
    lowered = decoder.decode.lower(params, plan.config, tokens, active, kv)
    lower_s = time.perf_counter() - start
    _, compile_s = timed(lowered.compile)
    return {"lower_s": lower_s, "compile_from_persistent_cache_s": compile_s}


def flags_in_subprocess(tiny: bool, timeout_s: float) -> dict[str, Any]:
    """The bs=1 and bs=64 decode steps in a child process run with ALTERNATIVE_XLA_FLAGS."""
    out = "/tmp/spark_jax_decode_flags"
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, OUT=out, XLA_FLAGS=ALTERNATIVE_XLA_FLAGS)
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.32"
    command = [sys.executable, __file__, "--modes", "bs1,batch", "--budget-s", str(timeout_s)]
    command += ["--batch-sizes", "4" if tiny else "64"] + (["--tiny"] if tiny else [])
    try:
        proc = subprocess.run(command, timeout=timeout_s, env=env, capture_output=True)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if proc.returncode != 0:
        return {"error": proc.stderr.decode()[-1500:]}
    child = json.loads(open(os.path.join(out, "decode.json")).read())
    keep = ("batch", "ms_step", "tok_s", "frac_floor", "compile_s", "hlo")
    rows = [child.get("bs1") or {}] + (child.get("batch") or [])
    return {"xla_flags": ALTERNATIVE_XLA_FLAGS, "runs": [{k: r.get(k) for k in keep} for r in rows]}


def startup_breakdown(results: dict[str, Any]) -> dict[str, Any]:
    """Issue 7 item 4: what stands between process start and the first token (seconds)."""
    bs1, engine, warm = (
        results.get("bs1") or {},
        results.get("engine") or {},
        results.get("warm_start") or {},
    )
    out: dict[str, Any] = {"init_params_s": results.get("init_params_s")}
    if "compile_s" in bs1:
        out["decode_trace_s"] = bs1["lower_s"]
        out["decode_compile_cold_s"] = bs1["compile_s"]
    if "cold" in engine:
        # The engine's first call compiles the prefill bucket (the decode step is shared).
        out["prefill_bucket_compile_s"] = engine["cold"]["ttft_s"] - engine["warm"]["ttft_s"]
        out["ttft_warm_s"] = engine["warm"]["ttft_s"]
    if "lower_s" in warm:
        out["decode_warm_cache_s"] = warm["lower_s"] + warm["compile_from_persistent_cache_s"]
    return out


# ---------------------------------------------------------------------------------------------
# The peer: HF transformers on the same GPU, in its own process.


def run_peer(plan: Plan) -> dict[str, Any]:
    """HF ``LlamaForCausalLM`` (bf16, random weights): per-token decode time after a prompt."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    c = plan.config
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf_config = LlamaConfig(**hf_llama_kwargs(c))
    torch.manual_seed(0)
    start = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = LlamaForCausalLM(hf_config).eval()
    if device == "cuda":
        torch.cuda.synchronize()
    results: dict[str, Any] = {"init_s": time.perf_counter() - start, "device": device}
    if device == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    cases = [(1, plan.hf_bs1_prompt), (plan.hf_batch, plan.hf_batch_prompt)]
    for impl in ("sdpa", "eager"):
        model.set_attn_implementation(impl)
        for batch, prompt in cases:
            key = f"{impl}_bs{batch}_prompt{prompt}"
            try:
                seconds = _hf_decode_seconds(model, batch, prompt, plan.hf_steps, device)
                results[key] = {"ms_step": seconds * 1e3, "tok_s": batch / seconds}
            except Exception as exc:
                results[key] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            if device == "cuda":
                torch.cuda.empty_cache()
    return results


def _hf_decode_seconds(model: Any, batch: int, prompt: int, steps: int, device: str) -> float:
    import torch

    with torch.inference_mode():
        ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device=device)
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        state = {"token": out.logits[:, -1:].argmax(-1)}

        def step() -> None:
            out = model(input_ids=state["token"], past_key_values=cache, use_cache=True)
            state["token"] = out.logits[:, -1:].argmax(-1)

        return torch_median_seconds(step, warmup=3, iters=steps)


def peer_in_subprocess(tiny: bool, timeout_s: float) -> dict[str, Any]:
    """Runs ``run_peer`` in a child process, before this process touches the GPU."""
    path = "/tmp/spark_jax_decode_peer.json"
    command = [sys.executable, __file__, "--peer-only", "--peer-json", path]
    command += ["--tiny"] if tiny else []
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, timeout=timeout_s, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        return {"error": f"peer timed out after {timeout_s:.0f} s"}
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:]}
    results = json.loads(open(path).read())
    results["process_s"] = time.perf_counter() - start
    return results


# ---------------------------------------------------------------------------------------------
# Output.


def plot(results: dict[str, Any], plan: Plan, bw: float) -> None:
    out = out_dir()
    batch = results.get("batch")
    if out is None or not batch:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [r["batch"] for r in batch]
    grid = np.geomspace(1, max(sizes), 64)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for bandwidth, style, label in (
        (bw, "-", "measured copy bw"),
        (HBM_BYTES_PER_S, "--", "4.3 TB/s"),
    ):
        floor = [b / decode_floor(plan.config, int(b), plan.batch_context, bandwidth) for b in grid]
        ax.plot(
            grid, floor, "k" + style, lw=1, label=f"HBM floor, ctx {plan.batch_context} ({label})"
        )
    ax.plot(sizes, [r["tok_s"] for r in batch], "o-", label="spark_jax decode step")
    for r in results.get("variants", []):
        if "tok_s" in r and r["max_len"] == plan.batch_context:
            ax.plot([r["batch"]], [r["tok_s"]], "s", label=f"variant {r['variant']}")
    peer = results.get("peer", {})
    for key, value in peer.items():
        if (
            isinstance(value, dict)
            and "tok_s" in value
            and key.endswith(f"bs{plan.hf_batch}_prompt{plan.hf_batch_prompt}")
        ):
            ax.plot(
                [plan.hf_batch],
                [value["tok_s"]],
                "x",
                label=f"HF {key.split('_')[0]} (prompt {plan.hf_batch_prompt})",
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens / s")
    ax.set_title("Llama-3-8B shapes, bf16, decode at context 2k (H200)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "decode_tok_s.png", dpi=120)


def summary_rows(results: dict[str, Any]) -> list[list[Any]]:
    rows = []
    for r in [results.get("bs1")] + results.get("batch", []):
        if r and "ms_step" in r:
            rows.append(
                [
                    f"decode bs={r['batch']} ctx={r['length']}",
                    r["ms_step"],
                    r["tok_s"],
                    r["frac_floor"],
                    r["compile_s"],
                ]
            )
    engine = results.get("engine")
    if engine and "warm" in engine:
        w = engine["warm"]
        rows.append(["engine.generate bs=1 (warm)", w["ms_token"], w["decode_tok_s"], None, None])
    for r in results.get("variants", []):
        if "ms_step" in r:
            rows.append(
                [
                    f"variant {r['variant']} bs={r['batch']}",
                    r["ms_step"],
                    r["tok_s"],
                    r["frac_floor"],
                    r["compile_s"],
                ]
            )
    p = results.get("prefill")
    if p and "ms" in p:
        rows.append(
            [f"prefill {p['batch']}x{p['length']}", p["ms"], p["tok_s"], p["frac_matmul"], None]
        )
    for key, value in results.get("peer", {}).items():
        if isinstance(value, dict) and "ms_step" in value:
            rows.append([f"HF {key}", value["ms_step"], value["tok_s"], None, None])
    return rows


# ---------------------------------------------------------------------------------------------


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny config (CPU smoke run)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
    parser.add_argument("--budget-s", type=float, default=540.0, help="skip stages past this")
    parser.add_argument("--batch-sizes", default="", help="comma list overriding the plan's")
    parser.add_argument("--heads-major-batches", default=None, help="comma list; '' for none")
    parser.add_argument("--cudnn-batches", default=None, help="comma list; '' for none")
    parser.add_argument(
        "--variant-plan", default="", help="e.g. 'split_kv=1,8;xla=1' (variant=batch sizes)"
    )
    parser.add_argument("--peer-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--peer-json", default="", help=argparse.SUPPRESS)
    add_flash_prefill_flag(parser)
    args = parser.parse_args()
    attention.FLASH_PREFILL_BY_DEFAULT = args.flash_prefill
    plan = SMALL if args.tiny else FULL
    if args.batch_sizes:
        plan = dataclasses.replace(plan, batch_sizes=_ints(args.batch_sizes))
    if args.heads_major_batches is not None:
        plan = dataclasses.replace(plan, heads_major_batches=_ints(args.heads_major_batches))
    if args.cudnn_batches is not None:
        plan = dataclasses.replace(plan, cudnn_batches=_ints(args.cudnn_batches))
    if args.peer_only:
        with open(args.peer_json, "w") as f:
            json.dump(run_peer(plan), f)
        return
    modes = set(args.modes.split(","))
    t0 = time.perf_counter()
    results: dict[str, Any] = {"benchmark": "decode", "tiny": args.tiny, "stages_s": {}}
    results["flash_prefill"] = args.flash_prefill

    def left() -> float:
        return args.budget_s - (time.perf_counter() - t0)

    def stage(name: str, need_s: float, fn: Callable[[], Any]) -> Any:
        if left() < need_s:
            results.setdefault("skipped", []).append(name)
            return None
        start = time.perf_counter()
        try:
            value = fn()
        except Exception as exc:
            value = {"error": f"{type(exc).__name__}: {str(exc)[:500]}"}
        results["stages_s"][name] = time.perf_counter() - start
        out = out_dir()
        if out is not None:  # a run killed at its time limit still leaves what it measured
            (out / "decode.json").write_text(json.dumps(results, default=str) + "\n")
        print(f"[{time.perf_counter() - t0:6.1f} s] {name}: done", flush=True)
        return value

    if "peer" in modes:  # first: the child must have the GPU to itself
        results["peer"] = stage("peer", 60, lambda: peer_in_subprocess(args.tiny, 150))

    # The flags child needs room of its own beside this process's preallocated pool.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.58" if "flags" in modes else "0.85")

    jax.config.update("jax_compilation_cache_dir", "/tmp/spark_jax_compile_cache")

    results["device"] = str(jax.devices()[0].device_kind)
    results["jax"] = jax.__version__
    bw = stage("copy_bandwidth", 0, lambda: copy_bandwidth(plan.copy_bytes))
    rate = stage("matmul_rate", 0, lambda: matmul_rate(plan.matmul_n))
    results["copy_bytes_per_s"], results["matmul_flop_s"] = bw, rate
    # A decode step reads and hardly writes: a read-only pass is its ceiling on this device.
    results["read_bytes_per_s"] = stage(
        "read_bandwidth", 0, lambda: read_bandwidth(plan.copy_bytes)
    )
    if "check" in modes:
        results["check"] = stage("check", 0, stage_check)
    params, init_s = timed(lambda: decoder.init_params(plan.config, jax.random.key(0), plan.dtype))
    results["init_params_s"] = init_s
    c = plan.config
    results["weight_bytes_per_step"] = weight_bytes_per_step(c)
    results["kv_bytes_per_token"] = kv_bytes_per_token(c)
    if "bs1" in modes:
        results["bs1"] = stage(
            "bs1",
            45,
            lambda: stage_decode(plan, params, 1, plan.bs1_context, plan.bs1_length, bw, "bs1"),
        )
        if "achieved_bytes_per_s" in results["bs1"]:
            results["bs1"]["frac_read_ceiling"] = (
                results["bs1"]["achieved_bytes_per_s"] / results["read_bytes_per_s"]
            )
    if "engine" in modes:
        results["engine"] = stage("engine", 45, lambda: stage_engine(plan, params))
    if "bs1" in modes:
        results["warm_start"] = stage("warm_start", 30, lambda: stage_warm_start(plan, params))
    if "batch" in modes:
        results["batch"] = []
        for b in plan.batch_sizes:
            length = plan.batch_context - 64
            r = stage(
                f"batch{b}",
                35,
                lambda b=b, length=length: stage_decode(
                    plan, params, b, plan.batch_context, length, bw, f"bs{b}"
                ),
            )
            if r is not None:
                results["batch"].append(r)
    if "prefill" in modes:
        results["prefill"] = stage("prefill", 40, lambda: stage_prefill(plan, params, rate))
    if "micro" in modes:
        results["micro"] = stage("micro", 30, lambda: stage_micro(plan, bw))
    if "variants" in modes:
        results["variants"] = []
        default = {"heads_major": plan.heads_major_batches, "cudnn": plan.cudnn_batches}
        variant_plan = _variant_plan(args.variant_plan) if args.variant_plan else default
        for name, batches in variant_plan.items():
            for b in batches:
                ctx, length = (
                    (plan.bs1_context, plan.bs1_length)
                    if b == 1
                    else (plan.batch_context, plan.batch_context - 64)
                )
                r = stage(
                    f"variant_{name}_bs{b}",
                    35,
                    lambda name=name, b=b, ctx=ctx, length=length: stage_variant(
                        plan, params, name, b, ctx, length, bw
                    ),
                )
                if r is not None:
                    results["variants"].append(r)
    if "flags" in modes:
        results["flags"] = stage(
            "flags", 90, lambda: flags_in_subprocess(args.tiny, min(150.0, left() - 20))
        )
    results["startup"] = startup_breakdown(results)
    results["total_s"] = time.perf_counter() - t0
    emit(results, "decode")
    try:
        plot(results, plan, bw)
    except Exception as exc:
        print(f"plot failed: {exc}")
    print(f"copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s, init {init_s:.1f} s")
    print_table(["what", "ms", "tok/s", "frac floor", "compile s"], summary_rows(results))


if __name__ == "__main__":
    main()
