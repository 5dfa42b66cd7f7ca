"""Attention kernels against their references and their peers, on the issue's shapes.

    PYTHONPATH=. python3 benchmarks/attention.py           # on the H200, bf16, ~4 minutes
    PYTHONPATH=. python3 benchmarks/attention.py --tiny    # tiny fp32 shapes, any backend

Cases: prefill, causal GQA 32/8, head dim 128 (B=1 S=8192, B=4 S=2048, B=1 S=2048), figures in
TFLOP/s of the causal half (``4 B N T S H / 2``); decode, GQA 32/8, head dim 128, every row at
length S=4096 (B=64 and B=1), figures in TB/s of K/V read (``2 B S K H`` elements). Each
implementation of a case is first checked against ``spark_jax.ops.attention.reference_attention``
in fp32 on the same random inputs, with the device's free memory poisoned with NaN just
before the run (so an output slot the kernel never writes shows up as NaN), then timed on
the device: calls back to back, the fixed cost of a chain (first launch, last sync) taken
out by timing chains of n and 2 n calls, n = iters / 2 (``us``; the torch peer by CUDA
events over a burst of 22 calls: 15 here at the default, as longer bursts run the H200 at
lower clocks, -6% at S=8192 over 60 calls in run e6 of BENCHMARKS.md), with the host-synced
time of one call beside it (``us_synced``, ~150-250 us more):

- ``pallas`` our Mosaic GPU kernels (``pallas_kernels``; interpreted off the GPU): the flash
  kernel for prefill (``_s3``: 3 K/V stages, ``_k128``: 128-key blocks) and the split-K
  kernel for decode (``_c128`` / ``_c64``: keys per program),
- ``pallas_ws<C>_k<L>_s<stages>`` the flash kernel with its warpgroups specialised: a
  producer issuing the K/V copies and C consumers of 64 query rows each (``consumers``),
  L-key blocks; ``pallas_flash_ws_k<L>_s<stages>`` the decode walk so (one consumer);
  ``_pingpong``: the two consumers take turns on the tensor cores (``pingpong``);
  ``_persistent``: one program per SM, each walking its share of the tiles (``programs``;
  the model's prefill: ``flash_attention.prefill_tuning``),
- ``pallas_flash`` the decode step through the flash kernel (``flash_decode_attention``, the
  route of ``implementation="pallas"`` at many rows; ``_k128``: 128-key blocks, ``_s3``: 64-key
  blocks in 3 stages),
- ``cudnn`` ``jax.nn.dot_product_attention(..., implementation="cudnn")`` (GPU only),
- ``stream_k<L>_s<stages>`` the ceiling of the decode walk's structure: its K/V copies alone
  (one program per kv head and row, L-key blocks by TMA into ``stages`` slots), no math;
  its check is void (it returns q), its TB/s is the figure,
- ``pallas_flash_headmajor`` / ``cudnn_headmajor`` the same decode over K/V stored head-major
  ([B, K, S, H], torch's layout; each kv head of a row as a row of its own),
- ``xla`` the reference as the engine runs it,
- ``cudnn_paged`` cuDNN's paged attention (``spark_jax.ops.attention.cache_attention``) over the
  same K/V laid out in 16-key pages of a shuffled pool, and ``gather_cudnn`` what the batching
  engine did before it: gather the pages into rows, then ``cudnn`` (decode cases, GPU only),
- ``pallas_paged`` our paged kernel (``pallas_kernels/paged_attention.py``) over the same pool,
  in place, 256-key chunks of 16 pages (decode cases; interpreted off the GPU), and
  ``pallas_paged_flash`` the flash walk over the same pool (8 pages per 128-key block;
  ``_s3`` 3 stages, ``_ws_s3`` with a producer warpgroup (the engine's), ``_k64_s4`` 64-key
  blocks in 4 stages),
- ``triton_mha`` / ``triton_gqa`` the deprecated ``jax.experimental.pallas.ops.gpu`` kernels
  (K/V heads repeated for ``mha``, which has no GQA), and ``mosaic_fa3`` JAX's own Mosaic GPU
  FA3 (``attention_mgpu``, GPU only; it applies no softmax scale, so its timing includes
  scaling q).

- ``torch_sdpa`` (GPU only, in a process of its own): PyTorch's
  ``scaled_dot_product_attention`` on the same shapes, by default (``enable_gqa``) and with
  K/V heads repeated under each backend (cuDNN, flash, memory-efficient), each checked
  against torch's fp32 math on the same inputs; ``best`` is the fastest correct one (the
  figure ../shared/DESIGN.md quotes as "torch SDPA").

A peer that fails records its error instead of a figure. ``--tiny`` runs fp32 with the
Pallas kernels in interpret mode: its timings mean nothing, its checks do.
Results: one JSON line on stdout (and $OUT/attention.json) and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    back_to_back_seconds,
    copy_bandwidth,
    emit,
    matmul_rate,
    median_seconds,
    print_table,
    read_bandwidth,
)
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.flash_attention import flash_attention, flash_decode_attention, sm_count
from pallas_kernels.paged_attention import paged_attention
from spark_jax.ops.attention import AttentionMask, reference_attention

ON_GPU = jax.default_backend() == "gpu"
Impl = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]  # q, k, v, lengths


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


FULL = [
    Case("prefill_s8192", "prefill", 1, 8192, 32, 8, 128, "bfloat16"),
    Case("prefill_s2048", "prefill", 4, 2048, 32, 8, 128, "bfloat16"),
    # DESIGN.md's "S=2048" row (cuDNN 166, torch 301) names no batch: B=1 too, from session 8.
    Case("prefill_b1_s2048", "prefill", 1, 2048, 32, 8, 128, "bfloat16"),
    Case("decode_b64_s4096", "decode", 64, 4096, 32, 8, 128, "bfloat16"),
    Case("decode_b1_s4096", "decode", 1, 4096, 32, 8, 128, "bfloat16"),
]
TINY = [
    Case("prefill_tiny", "prefill", 1, 128, 4, 2, 64, "float32"),
    Case("decode_tiny", "decode", 2, 256, 8, 2, 64, "float32"),
]


# ---------------------------------------------------------------------------------------------
# Inputs, the reference and the implementations.


def inputs(case: Case, seed: int = 0) -> tuple[jax.Array, ...]:
    """Random (never zero) q, k, v and lengths (every row at S)."""
    keys = jax.random.split(jax.random.key(seed), 3)
    shapes = [(case.b, case.t, case.n, case.h)] + [(case.b, case.s, case.kv_heads, case.h)] * 2
    q, k, v = (jax.random.normal(kk, sh, case.dtype) for kk, sh in zip(keys, shapes, strict=True))
    return q, k, v, jnp.full((case.b,), case.s, jnp.int32)


def mask_of(case: Case, lengths: jax.Array) -> AttentionMask:
    positions = jnp.broadcast_to(lengths[:, None] - case.t + jnp.arange(case.t), (case.b, case.t))
    return AttentionMask(positions, lengths, causal=True)


# Our kernels' configurations timed (names as in the module docstring).
PREFILL_TUNINGS: dict[str, dict[str, Any]] = {
    "pallas": {},
    "pallas_s3": {"stages": 3},
    "pallas_k128": {"block_k": 128},
    "pallas_ws2_k128_s2": {"block_k": 128, "consumers": 2},
    "pallas_ws2_k64_s3": {"block_k": 64, "stages": 3, "consumers": 2},
    "pallas_ws2_k128_s3": {"block_k": 128, "stages": 3, "consumers": 2},
    "pallas_ws2_k128_s2_pingpong": {"block_k": 128, "consumers": 2, "pingpong": True},
    "pallas_ws2_k64_s3_pingpong": {"block_k": 64, "stages": 3, "consumers": 2, "pingpong": True},
    "pallas_ws2_k64_s4_pingpong": {"block_k": 64, "stages": 4, "consumers": 2, "pingpong": True},
    "pallas_ws2_k128_s2_pingpong_persistent": {
        "block_k": 128,
        "consumers": 2,
        "pingpong": True,
        "programs": sm_count(),
    },
}
FLASH_DECODE_TUNINGS: dict[str, dict[str, Any]] = {
    "pallas_flash": {},
    "pallas_flash_k128": {"block_k": 128},
    "pallas_flash_s3": {"block_k": 64, "stages": 3},
    "pallas_flash_ws_k128_s3": {"block_k": 128, "stages": 3, "consumers": 1},
    "pallas_flash_ws_k64_s6": {"block_k": 64, "stages": 6, "consumers": 1},
}


def implementations(case: Case) -> dict[str, Impl | None]:
    """name -> implementation for the case (None: not available for this case or backend)."""
    scale = case.h**-0.5
    xla = lambda q, k, v, n: reference_attention(q, k, v, mask_of(case, n))  # noqa: E731
    if case.kind == "decode":
        pallas = partial(_pallas_decode, interpret=not ON_GPU)
        cudnn = partial(_cudnn, causal=False) if ON_GPU else None
        return {
            "pallas": pallas,
            "pallas_c128": partial(_pallas_decode, interpret=not ON_GPU, chunk=128),
            "pallas_c64": partial(_pallas_decode, interpret=not ON_GPU, chunk=64),
            **{
                name: partial(_pallas_flash_decode, interpret=not ON_GPU, **tuning)
                for name, tuning in FLASH_DECODE_TUNINGS.items()
            },
            "cudnn": cudnn,
            "pallas_flash_headmajor": _head_major(
                case, partial(_pallas_flash_decode, interpret=not ON_GPU)
            ),
            "cudnn_headmajor": _head_major(case, partial(_cudnn, causal=False)) if ON_GPU else None,
            "pallas_paged": _paged(case, partial(_pallas_paged, interpret=not ON_GPU)),
            "pallas_paged_flash": _paged(case, partial(_pallas_paged_flash, interpret=not ON_GPU)),
            **{
                f"pallas_paged_flash_{name}": _paged(
                    case, partial(_pallas_paged_flash, interpret=not ON_GPU, **tuning)
                )
                for name, tuning in (
                    ("s3", {"stages": 3}),
                    ("ws_s3", {"stages": 3, "consumers": 1}),
                    ("k64_s4", {"block_k": 64, "stages": 4}),
                )
            },
            "cudnn_paged": _paged(case, _cudnn_paged) if ON_GPU else None,
            "gather_cudnn": _paged(case, _gather_cudnn) if ON_GPU else None,
            "xla": xla,
            "triton_gqa": partial(_triton_gqa, scale=scale),
            **{
                f"stream_k{keys}_s{stages}": partial(
                    _stream, block_k=keys, stages=stages, interpret=not ON_GPU
                )
                for keys, stages in ((128, 2), (128, 3), (64, 4))
            },
        }
    return {
        **{
            name: partial(_pallas_prefill, interpret=not ON_GPU, **tuning)
            for name, tuning in PREFILL_TUNINGS.items()
        },
        "cudnn": partial(_cudnn, causal=True) if ON_GPU else None,
        "xla": xla,
        "triton_mha": partial(_triton_mha, scale=scale),
        "mosaic_fa3": _mosaic_fa3 if ON_GPU else None,
    }


def _pallas_decode(q, k, v, lengths, interpret: bool, chunk: int = 256) -> jax.Array:
    chunk = chunk if k.shape[1] % chunk == 0 else 64
    return decode_attention(q, k, v, lengths, chunk=chunk, interpret=interpret)


def _pallas_flash_decode(q, k, v, lengths, interpret: bool, **tuning: Any) -> jax.Array:
    return flash_decode_attention(q, k, v, lengths, interpret=interpret, **tuning)


def _pallas_prefill(q, k, v, lengths, interpret: bool, **tuning: Any) -> jax.Array:
    return flash_attention(q, k, v, lengths, lengths, causal=True, interpret=interpret, **tuning)


def _cudnn(q, k, v, lengths, causal: bool) -> jax.Array:
    if causal:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    return jax.nn.dot_product_attention(
        q, k, v, key_value_seq_lengths=lengths, implementation="cudnn"
    )


PAGE_SIZE = 16  # the batching engine's default


def _paged(case: Case, attend: Callable[..., jax.Array]) -> Impl:
    """``attend(q, k_pages, v_pages, lengths)`` over the case's K/V (``inputs``, same seed) in
    a shuffled pool of ``PagedLayer`` pages; ``run_case`` passes the pools (``run.operands``)
    in place of k and v, as arguments, not as jit constants."""
    from spark_jax.ops.kv_cache import PagedLayer

    _, k, v, _ = inputs(case)
    per_row = case.s // PAGE_SIZE
    order = np.random.default_rng(1).permutation(case.b * per_row)  # pool page of each block
    table = jnp.asarray(order.reshape(case.b, per_row), jnp.int32)
    inverse = jnp.asarray(np.argsort(order))

    def pool(x: jax.Array) -> PagedLayer:
        blocks = x.reshape(case.b * per_row, PAGE_SIZE, case.kv_heads, case.h)
        return PagedLayer(blocks[inverse], table)

    def run(q, k_pages, v_pages, lengths):
        return attend(q, k_pages, v_pages, lengths)

    run.operands = (pool(k), pool(v))  # type: ignore[attr-defined]
    return run


def _head_major(case: Case, attend: Impl) -> Impl:
    """``attend`` over the case's K/V stored head-major ([B, K, S, H], each row's kv head
    contiguous, as torch lays it out) instead of the engine's [B, S, K, H]: the kv heads
    become rows of one kv head each (``run.operands`` [B*K, S, 1, H]), q [B*K, 1, G, H]."""
    _, k, v, _ = inputs(case)
    group = case.n // case.kv_heads

    def run(q, k_rows, v_rows, lengths):
        rows = q.reshape(case.b * case.kv_heads, 1, group, case.h)
        out = attend(rows, k_rows, v_rows, jnp.repeat(lengths, case.kv_heads))
        return out.reshape(q.shape)

    run.operands = tuple(  # type: ignore[attr-defined]
        x.transpose(0, 2, 1, 3).reshape(case.b * case.kv_heads, case.s, 1, case.h) for x in (k, v)
    )
    return run


def _decode_mask(lengths: jax.Array) -> AttentionMask:
    return AttentionMask(lengths[:, None] - 1, lengths, causal=False)


def _pallas_paged(q, k_pages, v_pages, lengths, interpret: bool) -> jax.Array:
    table = k_pages.block_table
    return paged_attention(q, k_pages.pages, v_pages.pages, table, lengths, interpret=interpret)


def _pallas_paged_flash(q, k_pages, v_pages, lengths, interpret: bool, **tuning) -> jax.Array:
    table = k_pages.block_table
    return flash_decode_attention(
        q, k_pages.pages, v_pages.pages, lengths, block_table=table, interpret=interpret, **tuning
    )


def _cudnn_paged(q, k_pages, v_pages, lengths) -> jax.Array:
    from spark_jax.ops.attention import cache_attention

    return cache_attention(q, k_pages, v_pages, None, _decode_mask(lengths))


def _gather_cudnn(q, k_pages, v_pages, lengths) -> jax.Array:
    from spark_jax.ops.attention import cudnn_decode_attention

    mask = _decode_mask(lengths)
    return cudnn_decode_attention(q, k_pages.read(None), v_pages.read(None), mask)


def _triton_gqa(q, k, v, lengths, scale: float) -> jax.Array:
    from jax.experimental.pallas.ops.gpu import decode_attention as triton

    out = triton.gqa(q[:, 0], k, v, kv_seq_len=lengths, sm_scale=scale, interpret=not ON_GPU)
    return out[:, None]


def _triton_mha(q, k, v, lengths, scale: float) -> jax.Array:
    from jax.experimental.pallas.ops.gpu import attention as triton

    del lengths  # every row is full
    group = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, group, axis=2) for x in (k, v))
    return triton.mha(q, k, v, None, sm_scale=scale, causal=True, interpret=not ON_GPU)


def _mosaic_fa3(q, k, v, lengths) -> jax.Array:
    from jax.experimental.pallas.ops.gpu import attention_mgpu as fa3

    del lengths  # every row is full
    # JAX's kernel applies no softmax scale (its own reference has none): scale q first. It
    # takes float16 only (bfloat16 fails its dtype check): same width, same speed.
    dtype = q.dtype
    q = (q.astype(jnp.float32) * q.shape[-1] ** -0.5).astype(jnp.float16)
    config = fa3.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
    out = fa3.attention(q, k.astype(jnp.float16), v.astype(jnp.float16), config)
    return out.astype(dtype)


def _stream(q, k, v, lengths, block_k: int, stages: int, interpret: bool) -> jax.Array:
    """The decode walk's memory side alone: one program per (kv head, row) copies every K/V
    block of its row into ``stages`` shared-memory slots by TMA, as the flash walk does, and
    computes nothing: the bandwidth ceiling of that program structure. Returns q (so the
    check passes: this measures copies, not attention) after a dependency on the copies."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax import lax

    from pallas_kernels.decode_attention import _interpret_params, _smem_transforms

    b, s, kv_heads, h = k.shape
    steps = s // block_k
    tiled = _smem_transforms(k.dtype)

    def body(k_gmem, v_gmem, out_gmem, k_smem, v_smem, k_ready, v_ready):
        head, row = lax.axis_index("n"), lax.axis_index("b")

        def fetch(step):
            slot, keys = lax.rem(step, stages), pl.ds(step * block_k, block_k)
            plgpu.copy_gmem_to_smem(k_gmem.at[row, keys, head], k_smem.at[slot], k_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_gmem.at[row, keys, head], v_smem.at[slot], v_ready.at[slot])

        for ahead in range(min(stages - 1, steps)):
            fetch(ahead)

        @pl.loop(0, steps)
        def _walk(j):
            @pl.when(j + stages - 1 < steps)
            def _():
                fetch(j + stages - 1)

            plgpu.barrier_wait(k_ready.at[lax.rem(j, stages)])
            plgpu.barrier_wait(v_ready.at[lax.rem(j, stages)])

        plgpu.copy_smem_to_gmem(k_smem.at[0, pl.ds(0, 64)], out_gmem.at[row, head])
        plgpu.wait_smem_to_gmem(0)

    run = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((b, kv_heads, 64, h), k.dtype),
        scratch_types=[
            plgpu.SMEM((stages, block_k, h), k.dtype, transforms=tiled),
            plgpu.SMEM((stages, block_k, h), k.dtype, transforms=tiled),
            plgpu.Barrier(num_barriers=stages),
            plgpu.Barrier(num_barriers=stages),
        ],
        grid=(kv_heads, b),
        grid_names=("n", "b"),
        interpret=_interpret_params() if interpret else None,
    )
    touched = run(k, v)
    return q + (touched[:, :1, :1, :1].astype(q.dtype) * 0).reshape(b, 1, 1, 1)


# ---------------------------------------------------------------------------------------------
# Check and time.


def torch_sdpa(cases: list[Case], iters: int) -> dict[str, Any]:
    """PyTorch's SDPA on the cases (run in a child process: torch and JAX keep apart)."""
    import torch

    results: dict[str, Any] = {"torch": torch.__version__}
    for case in cases:
        results[case.name] = _torch_case(case, iters)
        torch.cuda.empty_cache()
    return results


def _torch_case(case: Case, iters: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from benchmarks.common import torch_median_seconds

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


def torch_sdpa_in_subprocess(case_names: list[str], iters: int) -> dict[str, Any]:
    """``torch_sdpa`` in a child process (``--torch-peer``); its error text on failure."""
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "torch.json")
        command = [sys.executable, __file__, "--torch-peer", path, "--iters", str(iters)]
        command += ["--cases", ",".join(case_names)]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if proc.returncode:
            return {"error": proc.stderr[-800:]}
        return json.loads(open(path).read())


def poison_free_memory(nbytes: int) -> None:
    """Fills ``nbytes`` of device memory with NaN and frees it, for the next outputs to reuse."""
    junk = jnp.full((max(nbytes, 4) // 4,), jnp.nan, jnp.float32)
    junk.block_until_ready()
    junk.delete()


def run_case(case: Case, iters: int, only: list[str] | None = None) -> dict[str, Any]:
    q, k, v, lengths = inputs(case)
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = jax.jit(reference_attention)(*up, mask_of(case, lengths))
    tolerance = 1e-2 if case.dtype in ("bfloat16", "float16") else 1e-5
    results: dict[str, Any] = {"case": asdict(case), "tolerance": tolerance}
    for name, impl in implementations(case).items():
        if only and not any(name.startswith(prefix) for prefix in only):
            continue
        if impl is None:
            results[name] = {"skipped": "not available for this case or backend"}
            continue
        fn = jax.jit(impl)
        kv = getattr(impl, "operands", (k, v))
        try:
            poison_free_memory(max(4 * q.size * 4, k.nbytes))
            out = jax.block_until_ready(fn(q, *kv, lengths)).astype(jnp.float32)
            rel = float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))
            entry: dict[str, Any] = {"rel_error": rel, "ok": bool(rel <= tolerance)}
            if name.startswith("stream"):  # copies only: no attention to check
                entry = {"check": "none: copies only"}
            call = partial(fn, q, *kv, lengths)
            # Back to back, a chain's launch and sync taken out: the device's time (as torch's
            # CUDA events measure its peer), not the host's (kept as ``us_synced``).
            seconds = back_to_back_seconds(call, max(iters // 2, 1))
            entry["us"] = seconds * 1e6
            entry["us_synced"] = median_seconds(call, warmup=0, iters=iters) * 1e6
            unit = "tflop_s" if case.kind == "prefill" else "tb_s"
            entry[unit] = case.work() / seconds / 1e12
        except Exception as error:  # a peer that fails records why, the run goes on
            entry = {"error": f"{type(error).__name__}: {error}"[:500]}
            traceback.print_exc()
        results[name] = entry
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny fp32 shapes (CPU smoke run)")
    parser.add_argument("--cases", default="", help="comma list of case names (default: all)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--impls", default="", help="comma list of name prefixes (default: all)")
    parser.add_argument("--torch-peer", default="", help=argparse.SUPPRESS)  # child: JSON path
    args = parser.parse_args()
    cases = TINY if args.tiny else FULL
    if args.cases:
        cases = [c for c in cases if c.name in args.cases.split(",")]
    if args.torch_peer:
        with open(args.torch_peer, "w") as f:
            json.dump(torch_sdpa(cases, args.iters), f)
        return
    results: dict[str, Any] = {"backend": jax.default_backend(), "jax": jax.__version__}
    if ON_GPU:
        results["device"] = jax.devices()[0].device_kind
        results["copy_tb_s"] = copy_bandwidth() / 1e12
        results["read_tb_s"] = read_bandwidth() / 1e12
        results["matmul_tflop_s"] = matmul_rate() / 1e12
        results["torch_sdpa"] = torch_sdpa_in_subprocess([c.name for c in cases], args.iters)
    for case in cases:
        only = [prefix for prefix in args.impls.split(",") if prefix]
        results[case.name] = run_case(case, 2 if args.tiny else args.iters, only)
        peer = results.get("torch_sdpa", {}).get(case.name, {}).get("best")
        if peer:
            results[case.name]["torch_sdpa_best"] = peer
    emit(results, "attention")
    rows = []
    for case in cases:
        for name, entry in results[case.name].items():
            if isinstance(entry, dict) and name != "case":
                figure = entry.get("tflop_s", entry.get("tb_s"))
                note = entry.get("error", entry.get("skipped", ""))[:60]
                rows.append(
                    [case.name, name, entry.get("rel_error"), figure, entry.get("us"), note]
                )
    print_table(["case", "impl", "rel err", "TFLOP/s|TB/s", "us", "note"], rows)
    failed = [
        (c.name, n)
        for c in cases
        for n, e in results[c.name].items()
        if isinstance(e, dict) and e.get("ok") is False and n.startswith("pallas")
    ]
    if failed:
        raise SystemExit(f"our kernels disagree with the reference: {failed}")


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
