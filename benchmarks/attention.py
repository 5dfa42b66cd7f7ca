"""Attention through the library's entry points against cuDNN, XLA and torch SDPA.

    python -m benchmarks attention           # on the H200, bf16, ~3 minutes
    python -m benchmarks attention --tiny    # tiny fp32 shapes, any backend

Cases: prefill, causal GQA 32/8, head dim 128 (B=1 S=8192, B=4 S=2048, B=1 S=2048), in
TFLOP/s of the causal half (``4 B N T S H / 2``); decode, GQA 32/8, head dim 128, every row at
S=4096 (B=64, B=1), in TB/s of K/V read (``2 B S K H`` elements), over a dense cache and over
16-key pages of a shuffled pool. Implementations: ``ours``, the library's ``attention`` (and
``cache_attention`` over pages) with our kernels picked (``KernelOptions(implementation=
"pallas")``; interpreted off the GPU); ``cudnn``, ``jax.nn.dot_product_attention`` with
cuDNN (dense) and the library's default paged path (cuDNN's paged attention); ``xla``, the
reference the library falls back to; ``torch_sdpa``, PyTorch's SDPA in a process of its own,
its default (``enable_gqa``) and each backend with K/V heads repeated, the fastest correct
one reported (CUDA events over 15 calls: longer bursts run the H200 at lower clocks).

Each implementation is first checked against the fp32 reference on the same random inputs,
with free device memory poisoned with NaN first (an output slot never written shows), then
timed as device time: calls back to back, a chain's fixed cost taken out
(``back_to_back_seconds``). A peer that fails records its error instead of a figure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    Report,
    Unsupported,
    back_to_back_seconds,
    kernel_options,
    on_gpu,
    peer_in_subprocess,
    ratio,
    torch_available,
    torch_median_seconds,
)

PAGE_SIZE = 16  # the batching engine's default


@dataclass(frozen=True)
class Case:
    """One benchmark shape: q [B,T,N,H], k/v [B,S,K,H]."""

    name: str
    kind: str  # "prefill" (T = S, causal) or "decode" (T = 1, keys < lengths)
    b: int
    s: int
    n: int
    kv_heads: int
    h: int
    dtype: str

    @property
    def t(self) -> int:
        return self.s if self.kind == "prefill" else 1

    def work(self) -> float:
        """FLOPs of the causal half (prefill) or bytes of K and V read (decode)."""
        if self.kind == "prefill":
            return 4 * self.b * self.n * self.t * self.s * self.h / 2
        return 2 * self.b * self.s * self.kv_heads * self.h * jnp.dtype(self.dtype).itemsize

    @property
    def unit(self) -> str:
        return "tflop_s" if self.kind == "prefill" else "tb_s"


FULL = [
    Case("prefill_s8192", "prefill", 1, 8192, 32, 8, 128, "bfloat16"),
    Case("prefill_b4_s2048", "prefill", 4, 2048, 32, 8, 128, "bfloat16"),
    Case("prefill_b1_s2048", "prefill", 1, 2048, 32, 8, 128, "bfloat16"),
    Case("decode_b64_s4096", "decode", 64, 4096, 32, 8, 128, "bfloat16"),
    Case("decode_b1_s4096", "decode", 1, 4096, 32, 8, 128, "bfloat16"),
]
TINY = [
    Case("prefill_tiny", "prefill", 1, 128, 4, 2, 64, "float32"),
    Case("decode_tiny", "decode", 2, 256, 8, 2, 64, "float32"),
]


def inputs(case: Case, seed: int = 0) -> tuple[jax.Array, ...]:
    """Random (never zero) q, k, v and lengths (every row at S)."""
    keys = jax.random.split(jax.random.key(seed), 3)
    shapes = [(case.b, case.t, case.n, case.h)] + [(case.b, case.s, case.kv_heads, case.h)] * 2
    q, k, v = (jax.random.normal(kk, sh, case.dtype) for kk, sh in zip(keys, shapes, strict=True))
    return q, k, v, jnp.full((case.b,), case.s, jnp.int32)


def mask_of(case: Case, lengths: jax.Array) -> Any:
    from spark_jax.ops.attention import AttentionMask

    if case.kind == "decode":
        return AttentionMask(lengths[:, None] - 1, lengths, causal=False)
    positions = jnp.broadcast_to(lengths[:, None] - case.t + jnp.arange(case.t), (case.b, case.t))
    return AttentionMask(positions, lengths, causal=True)


def paged(case: Case, k: jax.Array, v: jax.Array) -> tuple[Any, Any]:
    """k and v as ``PagedLayer`` pools of 16-key pages in a shuffled order."""
    from spark_jax.ops.kv_cache import PagedLayer

    per_row = case.s // PAGE_SIZE
    order = np.random.default_rng(1).permutation(case.b * per_row)  # pool page of each block
    table = jnp.asarray(order.reshape(case.b, per_row), jnp.int32)
    inverse = jnp.asarray(np.argsort(order))

    def pool(x: jax.Array) -> Any:
        blocks = x.reshape(case.b * per_row, PAGE_SIZE, case.kv_heads, case.h)
        return PagedLayer(blocks[inverse], table)

    return pool(k), pool(v)


def ours_kwargs(name: str) -> tuple[dict[str, Any], Callable[[], Any]]:
    """(keyword arguments, context) picking implementation ``name`` in the library: the
    options where the tree has them, else (an older tree) its ``implementation`` argument
    and, for the paged path, its trace-time override."""
    import contextlib

    try:
        return kernel_options(implementation=name), contextlib.nullcontext
    except Unsupported:
        from spark_jax.ops.attention import forced_implementation

        return {"implementation": name}, partial(forced_implementation, name)


def implementations(case: Case) -> dict[str, tuple[Callable[..., jax.Array] | None, tuple]]:
    """name -> (attend(q, k, v, lengths) or None where unavailable, its k/v operands)."""
    from spark_jax.ops import attention as lib

    q, k, v, lengths = inputs(case)
    kwargs, context = ours_kwargs("pallas")

    def ours(q, k, v, n):
        return lib.attention(q, k, v, mask_of(case, n), **kwargs)

    def xla(q, k, v, n):
        return lib.reference_attention(q, k, v, mask_of(case, n))

    def cudnn(q, k, v, n):
        if case.kind == "prefill":
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return jax.nn.dot_product_attention(
            q, k, v, key_value_seq_lengths=n, implementation="cudnn"
        )

    impls: dict[str, tuple[Callable[..., jax.Array] | None, tuple]] = {
        "ours": (ours, (k, v)),
        "cudnn": (cudnn if on_gpu() else None, (k, v)),
        "xla": (xla, (k, v)),
    }
    if case.kind == "decode":
        pools = paged(case, k, v)
        cache_kwargs = {k_: v_ for k_, v_ in kwargs.items() if k_ == "options"}

        def ours_paged(q, kp, vp, n):
            with context():
                return lib.cache_attention(q, kp, vp, None, mask_of(case, n), **cache_kwargs)

        def cudnn_paged(q, kp, vp, n):
            return lib.cache_attention(q, kp, vp, None, mask_of(case, n))

        impls["ours_paged"] = (ours_paged, pools)
        impls["cudnn_paged"] = (cudnn_paged if on_gpu() else None, pools)
    return impls


def poison_free_memory(nbytes: int) -> None:
    """Fills ``nbytes`` of device memory with NaN and frees it, for the next outputs to reuse."""
    junk = jnp.full((max(nbytes, 4) // 4,), jnp.nan, jnp.float32)
    junk.block_until_ready()
    junk.delete()


def run_case(case: Case, iters: int) -> dict[str, Any]:
    from spark_jax.ops.attention import reference_attention

    q, k, v, lengths = inputs(case)
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = jax.jit(reference_attention)(*up, mask_of(case, lengths))
    tolerance = 1e-2 if case.dtype in ("bfloat16", "float16") else 1e-5
    results: dict[str, Any] = {}
    for name, (impl, operands) in implementations(case).items():
        if impl is None:
            results[name] = {"skipped": "needs a GPU"}
            continue
        fn = jax.jit(impl)
        try:
            poison_free_memory(max(4 * q.size * 4, k.nbytes))
            out = jax.block_until_ready(fn(q, *operands, lengths)).astype(jnp.float32)
            rel = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
            entry: dict[str, Any] = {"rel_error": rel, "ok": bool(rel <= tolerance)}
            # One repeat when tiny: the interpreted kernels take ~1 s a call on the CPU.
            repeats = 1 if iters < 4 else 5
            call = partial(fn, q, *operands, lengths)
            seconds = back_to_back_seconds(call, max(iters // 2, 1), repeats=repeats)
            entry["us"] = seconds * 1e6
            entry[case.unit] = case.work() / seconds / 1e12
        except Exception as error:  # an implementation that fails records why
            entry = {"error": f"{type(error).__name__}: {error}"[:400]}
        results[name] = entry
    return results


def run(tiny: bool, peer: bool = True) -> Report:
    cases = TINY if tiny else FULL
    report = Report()
    if not on_gpu():
        report.notes.append("torch SDPA and cuDNN peers need a GPU: skipped")
        torch: dict[str, Any] = {}
    elif not peer:
        report.notes.append("torch SDPA left out (--no-peer)")
        torch = {}
    elif not torch_available():
        report.notes.append("torch not installed: torch SDPA skipped")
        torch = {}
    else:
        torch = peer_in_subprocess("attention", tiny, timeout_s=600)
        if "error" in torch:
            report.notes.append(f"torch SDPA: {torch['error'][-300:]}")
    table = [["case", "impl", "rel err", "TFLOP/s | TB/s", "us", "note"]]
    for case in cases:
        entries = run_case(case, 2 if tiny else 10)
        best = (torch.get(case.name) or {}).get("best")
        if best:
            entries["torch_sdpa"] = best
        report.details[case.name] = entries
        for name, entry in entries.items():
            figure = entry.get(case.unit)
            key = f"{case.name}_{name}_{case.unit}"
            if figure and name.startswith("ours"):
                report.figures[key] = figure
            elif figure:
                report.peers[key] = figure
            note = entry.get("error", entry.get("skipped", entry.get("backend", "")))
            table.append([case.name, name, entry.get("rel_error"), figure, entry.get("us"), note])
        for ours_name, peer_names in (
            ("ours", ("cudnn", "torch_sdpa", "xla")),
            ("ours_paged", ("cudnn_paged",)),
        ):
            ours = entries.get(ours_name, {}).get(case.unit)
            for peer_name in peer_names:
                theirs = entries.get(peer_name, {}).get(case.unit)
                if ours and theirs:
                    report.ratios[f"{case.name}_{ours_name}_over_{peer_name}"] = ratio(ours, theirs)
        wrong = [n for n, e in entries.items() if n.startswith("ours") and e.get("ok") is False]
        if wrong:
            report.notes.append(f"{case.name}: {wrong} disagree with the reference")
    report.table = table
    return report


# ---------------------------------------------------------------------------------------------
# The torch SDPA peer (a child process: torch and JAX keep apart).


def peer(tiny: bool, arg: str = "") -> dict[str, Any]:
    """PyTorch's SDPA on the cases."""
    import torch

    results: dict[str, Any] = {"torch": torch.__version__}
    for case in TINY if tiny else FULL:
        results[case.name] = _torch_case(case, 15)
        torch.cuda.empty_cache()
    return results


def _torch_case(case: Case, iters: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    generator = torch.Generator(device="cuda").manual_seed(0)
    dtype = getattr(torch, case.dtype)
    q = torch.randn(case.b, case.n, case.t, case.h, device="cuda", dtype=dtype, generator=generator)
    k, v = (
        torch.randn(case.b, case.kv_heads, case.s, case.h, device="cuda", dtype=dtype) for _ in "kv"
    )
    wide_k, wide_v = (x.repeat_interleave(case.n // case.kv_heads, dim=1) for x in (k, v))
    causal = case.kind == "prefill"  # decode: one query seeing every key
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(
            q.float(), wide_k.float(), wide_v.float(), is_causal=causal
        )

    def run(backend: SDPBackend | None) -> torch.Tensor:
        if backend is None:  # torch's own pick, GQA without repeated heads
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, wide_k, wide_v, is_causal=causal)

    backends = {
        "default_gqa": None,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    entries: dict[str, Any] = {}
    for name, backend in backends.items():
        try:
            out = run(backend).float()
            rel = float((out - ref).norm() / ref.norm())
            seconds = torch_median_seconds(partial(run, backend), warmup=2, iters=iters)
            unit = "tflop_s" if case.kind == "prefill" else "tb_s"
            entries[name] = {
                "rel_error": rel,
                "ok": rel <= 1e-2,
                "us": seconds * 1e6,
                unit: case.work() / seconds / 1e12,
            }
        except Exception as error:  # a backend that refuses the shape records why
            entries[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
    good = {n: e for n, e in entries.items() if e.get("ok")}
    if good:
        best = min(good, key=lambda n: good[n]["us"])
        entries["best"] = {"backend": best, **good[best]}
    return entries
