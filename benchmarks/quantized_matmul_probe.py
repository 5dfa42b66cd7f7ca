"""Probe (kept out of the suites): weight-only fp8/int8 matmul at decode rows on Llama-3-8B
shapes, every variant device-timed in one process.

    PYTHONPATH=. python benchmarks/quantized_matmul_probe.py [--rows 1] [--quick] [--only NAME ...]

Each variant computes ``x [M, D] @ (q [D, F] * scale [F])`` for the four projections of
``--layers`` layers (separate arrays, so nothing stays in L2) inside one jitted call; the
figure is narrow bytes read per second of device time (``back_to_back_seconds``), beside
XLA's bf16 GEMV over the same shapes and the read ceiling of this run. Variants:

- ``bf16``: XLA's dot on bf16 weights (bytes counted at 2 a weight); ``bf16half``: the same on
  half the columns, the narrow weights' bytes: what a matmul of that size reads at.
- ``xla_fused``: XLA's dot with the convert fused into its operand (the CPU's path).
- ``xla_rows``: a row reduction over transposed narrow weights ``[F, D]`` (one row a dot);
  ``xla_cols``: the column reduction over ``[D, F]`` as the model holds them.
- ``kernel``: ``pallas_kernels.quantized_matmul`` as the model calls it.
- ``tile``: the kernel's form with the products summed over the inputs once per program
  instead of once per tile (``elementwise``), on ``[D, F]`` or ``[F, D]`` weights, with its
  tile, warps, stages and splits named.

``--rows M`` (> 1, a decode step of M rows): only the forms that take several rows run:
``bf16``, ``bf16half``, ``xla_fused`` (the engine's path above 16 rows), ``kernel`` and its
tiles (``kernel_n{block_n}_k{block_k}_w{warps}_s{stages}_p{programs}``), and ``w8a8_fd``: x
rounded to E4M3 with a scale a row against ``[F, D]`` weights in one fp8 dot (cuBLASLt's fp8
GEMM takes both operands K-major), what a W8A8 scheme over the transposed layout would read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.experimental.pallas as pl
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks.common import back_to_back_seconds, read_bandwidth
from pallas_kernels._mosaic import triton_params
from pallas_kernels.quantized_matmul import quantized_matmul, quantized_matmul_reference
from spark_jax.ops.quant import quantize

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}


def tile_matmul(
    x,
    w,
    scale,
    *,
    layout,
    block_in,
    block_out,
    splits,
    warps,
    stages,
    per_tile=False,
    interpret=False,
):
    """``x [1, D] @ (q * scale)`` with weights ``w`` as ``[D, F]`` (layout "df") or ``[F, D]``
    ("fd"); each program sums products elementwise into a [block_in, block_out] fp32 tile and
    reduces it over the inputs once at the end."""
    if layout == "df":
        d, f = w.shape
    else:
        f, d = w.shape
    chunk = d // splits
    steps = chunk // block_in

    def kernel(x_ref, w_ref, o_ref):
        def step(i, acc):
            inputs = pl.ds(pl.multiple_of(i * block_in, block_in), block_in)
            xs = x_ref[0, inputs].astype(jnp.float32)
            if per_tile:  # the column sum per tile (the kernel's form before)
                return acc + jnp.sum(xs[:, None] * w_ref[inputs, :].astype(jnp.float32), 0)[None]
            if layout == "df":
                return acc + xs[:, None] * w_ref[inputs, :].astype(jnp.float32)
            return acc + w_ref[:, inputs].astype(jnp.float32) * xs[None, :]

        shape = (block_in, block_out) if layout == "df" else (block_out, block_in)
        if per_tile:
            o_ref[...] = lax.fori_loop(0, steps, step, jnp.zeros((1, block_out), jnp.float32))
        else:
            acc = lax.fori_loop(0, steps, step, jnp.zeros(shape, jnp.float32))
            o_ref[...] = jnp.sum(acc, axis=0 if layout == "df" else 1)[None]

    if layout == "df":
        w_spec = pl.BlockSpec((chunk, block_out), lambda j, s: (s, j))
    else:
        w_spec = pl.BlockSpec((block_out, chunk), lambda j, s: (j, s))
    partial = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits, 1, f), jnp.float32),
        grid=(f // block_out, splits),
        in_specs=[pl.BlockSpec((1, chunk), lambda j, s: (0, s)), w_spec],
        out_specs=pl.BlockSpec((None, 1, block_out), lambda j, s: (s, 0, j)),
        compiler_params=triton_params(warps, stages, interpret),
        interpret=interpret,
        name="tile_matmul",
    )(x, w)
    return (jnp.sum(partial, axis=0) * scale).astype(x.dtype)


def dot_matmul(x, wt, scale, *, block_in, block_out, splits, warps, stages, widen, interpret=False):
    """``x [1, D] @ (q * scale)`` with weights ``wt [F, D]`` on the tensor cores: each program
    computes ``wt[block_out, :] @ x^T`` (x padded to 16 columns, in ``widen``'s dtype), the
    narrow tile widened in registers as the dot's first operand."""
    f, d = wt.shape
    chunk = d // splits
    steps = chunk // block_in
    if widen == jnp.float16:
        big = float(jnp.finfo(jnp.float16).max)
        xw = jnp.clip(x.astype(jnp.float32), -big, big).astype(jnp.float16)
    else:
        xw = x.astype(widen)
    xt = jnp.pad(xw, ((0, 16 - x.shape[0]), (0, 0))).T  # [D, 16]

    def kernel(x_ref, w_ref, o_ref):
        def step(i, acc):
            inputs = pl.ds(pl.multiple_of(i * block_in, block_in), block_in)
            w = w_ref[:, inputs].astype(widen)
            return acc + jnp.dot(w, x_ref[inputs, :], preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, steps, step, jnp.zeros((block_out, 16), jnp.float32))
        first = lax.broadcasted_iota(jnp.int32, (block_out, 16), 1) == 0
        o_ref[...] = jnp.sum(jnp.where(first, acc, 0.0), axis=1)[None]

    partial = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((splits, 1, f), jnp.float32),
        grid=(f // block_out, splits),
        in_specs=[
            pl.BlockSpec((chunk, 16), lambda j, s: (s, 0)),
            pl.BlockSpec((block_out, chunk), lambda j, s: (j, s)),
        ],
        out_specs=pl.BlockSpec((None, 1, block_out), lambda j, s: (s, 0, j)),
        compiler_params=triton_params(warps, stages, interpret),
        interpret=interpret,
        name="dot_matmul",
    )(xt, wt)
    return (jnp.sum(partial, axis=0) * scale).astype(x.dtype)


def tma_matmul(x, wt, scale, *, tile_k, stages, splits, load_layout="UPCAST_2X", interpret=False):
    """``x [M, D] @ (wt.T * scale)`` with weights ``wt [F, D]`` (Mosaic GPU): each program
    streams its [64, D / splits] slice of the narrow weights by TMA through ``stages`` shared
    buffers, widens each tile in registers (fp8 -> fp16 by ``cvt``, int8 -> bf16) as wgmma's
    first operand, and multiplies it by x^T (padded to 8 columns, read transposed from shared
    memory); the splits' fp32 partials are summed and scaled after it."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    from pallas_kernels._mosaic import interpret_params, smem_transforms

    m, d = x.shape
    f = wt.shape[0]
    tile_f, n = 64, 8
    if m > n:
        raise ValueError(f"tma_matmul takes at most {n} rows of x, got {m}")
    widen = jnp.float16 if wt.dtype == jnp.float8_e4m3fn else jnp.bfloat16
    xw = x.astype(jnp.float32)
    if widen == jnp.float16:
        big = float(jnp.finfo(jnp.float16).max)
        xw = jnp.clip(xw, -big, big)
    xw = jnp.pad(xw.astype(widen), ((0, n - m), (0, 0)))  # [8, D]
    chunk = d // splits
    steps = chunk // tile_k

    def body(x_gmem, w_gmem, out_gmem, out_smem, w_wide, x_t):
        fi, si = lax.axis_index("f"), lax.axis_index("s")
        inputs = pl.ds(si * chunk, chunk)

        def step(_, w_smem, x_smem, acc):
            if interpret:
                w_wide[...] = w_smem[...].astype(widen)
                x_t[...] = x_smem[...].T
                plgpu.commit_smem()

                def fresh(acc_ref):
                    plgpu.wgmma(acc_ref, w_wide, x_t)
                    return acc_ref[...]

                return acc + pl.run_scoped(fresh, plgpu.ACC((tile_f, n), jnp.float32))
            layout = getattr(plgpu.Layout, f"WGMMA_{load_layout}")
            w = plgpu.load(w_smem, (), layout=layout).astype(widen)
            w = plgpu.layout_cast(w, plgpu.Layout.WGMMA)

            def product(acc_ref):
                plgpu.wgmma(acc_ref, w, x_smem.transpose((1, 0)))

            return pl.run_state(product)(plgpu.ACC.init(acc))

        pipeline = plgpu.emit_pipeline(
            step,
            grid=(steps,),
            in_specs=[
                plgpu.BlockSpec(
                    (tile_f, tile_k), lambda k: (0, k), transforms=smem_transforms(wt.dtype)
                ),
                plgpu.BlockSpec((n, tile_k), lambda k: (0, k), transforms=smem_transforms(widen)),
            ],
            max_concurrent_steps=stages,
            init_carry=jnp.zeros((tile_f, n), jnp.float32)
            if interpret
            else plgpu.layout_cast(jnp.zeros((tile_f, n), jnp.float32), plgpu.Layout.WGMMA),
        )
        acc = pipeline(w_gmem.at[pl.ds(fi * tile_f, tile_f), inputs], x_gmem.at[:, inputs])
        out_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[si, pl.ds(fi * tile_f, tile_f)])
        plgpu.wait_smem_to_gmem(0)

    scratch = [
        plgpu.SMEM((tile_f, n), jnp.float32),
        plgpu.SMEM((tile_f, tile_k), widen, transforms=smem_transforms(widen))
        if interpret
        else None,
        plgpu.SMEM((tile_k, n), widen) if interpret else None,
    ]
    partial = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((splits, f, n), jnp.float32),
        scratch_types=scratch,
        grid=(f // tile_f, splits),
        grid_names=("f", "s"),
        interpret=interpret_params() if interpret else None,
    )(xw, wt)
    y = jnp.sum(partial, axis=0)[:, :m].T  # [M, F]
    return (y * scale).astype(x.dtype)


def jax_mixed_matmul(x, wt, scale):
    """JAX's own Hopper mixed-type matmul (Mosaic GPU: int8 tiles by TMA into shared memory,
    widened in registers as wgmma's first operand) on ``wt [F, D]`` int8 times x^T padded to
    64 columns: no split of D, so a projection gets F / 128 programs."""
    from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as mixed

    config = mixed.TuningConfig(
        tile_m=64, tile_n=64, tile_k=128, max_concurrent_steps=4,
        wg_dimension=mixed.MatmulDimension.M,
    )  # fmt: skip
    xt = jnp.pad(x, ((0, 64 - x.shape[0]), (0, 0))).T  # [D, 64]
    y = mixed.mixed_matmul_kernel(wt, xt, out_dtype=jnp.float32, config=config)  # [F, 64]
    return (y[:, 0] * scale)[None].astype(x.dtype)


# The kernel's tiles at several rows: block_n, block_k, warps, stages, programs.
ROW_TILES = [
    (64, 64, 4, 4, 528),
    (128, 64, 4, 4, 528),
    (128, 128, 4, 3, 528),
    (128, 128, 8, 3, 528),
    (64, 128, 4, 3, 1056),
    (128, 256, 8, 3, 528),
    (256, 64, 8, 3, 264),
    (128, 64, 4, 3, 1056),
]


def w8a8_fd(x, q, s, qt, name):
    """x rounded to E4M3 (a scale a row) against ``qt [F, D]`` in one fp8 x fp8 dot, both
    operands contracted on their last axis; the two scales applied to its fp32 output."""
    del q, name
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1, keepdims=True)
    x_scale = jnp.where(amax > 0, amax / 448.0, 1.0)
    x8 = (x.astype(jnp.float32) / x_scale).astype(jnp.float8_e4m3fn)
    y = lax.dot_general(x8, qt, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * x_scale * s).astype(jnp.bfloat16)


def _pow2_divisor(n, largest):
    while n % largest:
        largest //= 2
    return largest


def splits_for(d, f, block_in, block_out, programs):
    splits = 1
    while (f // block_out) * splits * 2 <= programs and d % (block_in * splits * 2) == 0:
        splits *= 2
    return splits


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", nargs="+", default=None, help="variants whose name has one")
    parser.add_argument("--rows", type=int, default=1, help="rows of x (a decode step's)")
    args = parser.parse_args()
    key = jax.random.key(0)
    layers = []
    for i in range(args.layers):
        for name, (d, f) in SHAPES.items():
            w = jax.random.normal(jax.random.fold_in(key, i * 10 + len(name)), (d, f), jnp.float32)
            w = (w * 0.02).astype(jnp.bfloat16)
            # bf16 weights of half the columns: the narrow weights' bytes in bf16 (is a
            # matmul of that size capped below the read ceiling, whatever its type?)
            entry = {"name": name, "bf16": w, "bf16half": (w[:, : f // 2].copy(),)}
            for scheme in ("fp8", "int8"):
                q, s = quantize(w, scheme)
                entry[scheme] = (q, s, q.T.copy())
            layers.append(entry)
            del w
    xs = {
        d: jax.random.normal(jax.random.fold_in(key, d), (args.rows, d), jnp.bfloat16)
        for d in sorted({d for d, _ in SHAPES.values()})
    }
    narrow_bytes = sum(e["fp8"][0].size for e in layers)
    jax.block_until_ready(layers)

    def run_all(fn, scheme):
        def call(weights):
            outs = []
            for e, w in zip(layers, weights, strict=True):
                outs.append(fn(xs[w[0].shape[0]], *w, e["name"]))
            return outs

        weights = [e[scheme] if scheme != "bf16" else (e["bf16"],) for e in layers]
        jitted = jax.jit(call)
        return lambda: jitted(weights)

    variants = {}
    variants["bf16half"] = (
        "bf16half",
        lambda x, w, name: jnp.dot(x, w, preferred_element_type=jnp.bfloat16),
    )
    variants["bf16"] = (
        "bf16",
        lambda x, w, name: jnp.dot(x, w, preferred_element_type=jnp.bfloat16),
    )
    for scheme in ("fp8", "int8"):
        variants[f"xla_fused_{scheme}"] = (
            scheme,
            lambda x, q, s, qt, name: quantized_matmul_reference(x, q, s, jnp.bfloat16),
        )
        variants[f"xla_rows_{scheme}"] = (
            scheme,
            lambda x, q, s, qt, name: (
                jnp.sum(qt.astype(jnp.float32) * x.astype(jnp.float32), axis=1)[None] * s
            ).astype(jnp.bfloat16),
        )
        variants[f"xla_cols_{scheme}"] = (
            scheme,
            lambda x, q, s, qt, name: (
                jnp.sum(q.astype(jnp.float32) * x.astype(jnp.float32).T, axis=0)[None] * s
            ).astype(jnp.bfloat16),
        )
        variants[f"kernel_{scheme}"] = (
            scheme,
            lambda x, q, s, qt, name: quantized_matmul(x, q, s, jnp.bfloat16),
        )
    configs = [
        # layout, block_in, block_out, warps, stages, programs
        ("df", 64, 128, 4, 3, 1056),
        ("df", 32, 256, 4, 3, 1056),
        ("df", 64, 256, 8, 3, 1056),
        ("df", 128, 128, 8, 3, 1056),
        ("df", 64, 128, 4, 3, 4224),
        ("df", 64, 128, 4, 1, 1056),
        ("df", 32, 128, 4, 3, 2112),
        ("fd", 256, 16, 4, 3, 1056),
        ("fd", 512, 16, 4, 3, 1056),
        ("fd", 256, 32, 4, 3, 1056),
        ("fd", 512, 8, 4, 3, 1056),
        ("fd", 1024, 8, 8, 3, 1056),
        ("fd", 256, 32, 8, 3, 2112),
        ("fd", 512, 16, 4, 1, 4224),
    ]
    dot_configs = [
        # block_in, block_out, warps, stages, programs, widen
        (128, 64, 4, 3, 1056, jnp.float16),
        (128, 64, 4, 4, 528, jnp.float16),
        (256, 64, 4, 3, 1056, jnp.float16),
        (128, 128, 4, 3, 1056, jnp.float16),
        (64, 64, 4, 3, 2112, jnp.float16),
        (256, 128, 8, 3, 1056, jnp.float16),
        (128, 64, 4, 3, 1056, jnp.bfloat16),
    ]
    for bi, bo, warps, stages, programs, widen in dot_configs:
        for scheme in ("fp8",) + (("int8",) if (bi, bo, stages) == (128, 64, 3) else ()):

            def fn(
                x,
                q,
                s,
                qt,
                name,
                bi=bi,
                bo=bo,
                warps=warps,
                stages=stages,
                programs=programs,
                widen=widen,
            ):
                d, f = q.shape
                splits = splits_for(d, f, bi, bo, programs)
                return dot_matmul(
                    x,
                    qt,
                    s,
                    block_in=bi,
                    block_out=bo,
                    splits=splits,
                    warps=warps,
                    stages=stages,
                    widen=widen,
                )

            tag = "f16" if widen == jnp.float16 else "bf16"
            variants[f"dot_fd_{bi}x{bo}_w{warps}_s{stages}_p{programs}_{tag}_{scheme}"] = (
                scheme,
                fn,
            )
    for scheme in ("fp8", "int8"):

        def before(x, q, s, qt, name):
            d, f = q.shape
            return tile_matmul(
                x,
                q,
                s,
                layout="df",
                block_in=_pow2_divisor(d, 256),
                block_out=128,
                splits=splits_for(d, f, _pow2_divisor(d, 256), 128, 528),
                warps=4,
                stages=4,
                per_tile=True,
            )

        variants[f"kernel_before_{scheme}"] = (scheme, before)
    if args.quick:
        configs = configs[:2] + configs[7:9]
    for layout, bi, bo, warps, stages, programs in configs:
        for scheme in ("fp8",) + (
            ("int8",) if (layout, bi, bo) in (("df", 64, 128), ("fd", 512, 16)) else ()
        ):

            def fn(
                x,
                q,
                s,
                qt,
                name,
                layout=layout,
                bi=bi,
                bo=bo,
                warps=warps,
                stages=stages,
                programs=programs,
            ):
                w = q if layout == "df" else qt
                d, f = q.shape
                splits = splits_for(d, f, bi, bo, programs)
                return tile_matmul(
                    x,
                    w,
                    s,
                    layout=layout,
                    block_in=bi,
                    block_out=bo,
                    splits=splits,
                    warps=warps,
                    stages=stages,
                )

            variants[f"tile_{layout}_{bi}x{bo}_w{warps}_s{stages}_p{programs}_{scheme}"] = (
                scheme,
                fn,
            )

    tma_configs = [
        # tile_k, stages, programs, load layout
        (128, 4, 528, "UPCAST_2X"),
        (128, 4, 528, "8BIT"),
        (256, 4, 264, "UPCAST_2X"),
        (256, 3, 528, "UPCAST_2X"),
        (512, 2, 264, "UPCAST_2X"),
        (128, 8, 264, "UPCAST_2X"),
        (256, 6, 264, "UPCAST_2X"),
    ]
    for tk, stages, programs, load_layout in tma_configs:
        for scheme in ("fp8",) + (("int8",) if (tk, stages) == (256, 4) else ()):

            def fn(x, q, s, qt, name, tk=tk, stages=stages, programs=programs, ll=load_layout):
                d, f = q.shape
                splits = splits_for(d, f, tk, 64, programs)
                while splits > 1 and d // splits // tk < stages:
                    splits //= 2
                return tma_matmul(x, qt, s, tile_k=tk, stages=stages, splits=splits, load_layout=ll)

            variants[f"tma_{tk}_s{stages}_p{programs}_{load_layout}_{scheme}"] = (scheme, fn)

    if args.rows > 1:
        several = (
            "bf16",
            "bf16half",
            "xla_fused_fp8",
            "xla_fused_int8",
            "kernel_fp8",
            "kernel_int8",
        )
        variants = {k: v for k, v in variants.items() if k in several}
        for bn, bk, warps, stages, programs in ROW_TILES:
            for scheme in ("fp8",) + (("int8",) if (bn, bk) == (128, 128) else ()):
                variants[f"kernel_n{bn}_k{bk}_w{warps}_s{stages}_p{programs}_{scheme}"] = (
                    scheme,
                    lambda x, q, s, qt, name, t=(bn, bk, warps, stages, programs): quantized_matmul(
                        x, q, s, jnp.bfloat16, block_n=t[0], block_k=t[1], num_warps=t[2],
                        num_stages=t[3], programs=t[4],
                    ),
                )  # fmt: skip
        variants["w8a8_fd_fp8"] = ("fp8", w8a8_fd)
    ceiling = read_bandwidth()
    rows = []
    reference = {}
    for scheme in ("fp8", "int8"):
        outs = run_all(variants[f"xla_fused_{scheme}"][1], scheme)()
        reference[scheme] = [np.asarray(o, np.float32) for o in outs]
    for scheme in ("int8",):

        def mixed(x, q, s, qt, name):
            return jax_mixed_matmul(x, qt, s)

        variants[f"jax_mixed_{scheme}"] = (scheme, mixed)
    if args.only:
        variants = {k: v for k, v in variants.items() if any(o in k for o in args.only)}
    for name, (scheme, fn) in variants.items():
        try:
            call = run_all(fn, scheme)
            outs = call()
            err = None
            if scheme in ("fp8", "int8"):
                num = sum(
                    float(np.sum((np.asarray(o, np.float32) - r) ** 2))
                    for o, r in zip(outs, reference[scheme], strict=True)
                )
                den = sum(float(np.sum(r**2)) for r in reference[scheme])
                err = (num / den) ** 0.5
            seconds = back_to_back_seconds(call, calls=10)
            nbytes = narrow_bytes * (2 if scheme == "bf16" else 1)
            rows.append(
                {
                    "variant": name,
                    "us_per_layer": seconds / args.layers * 1e6,
                    "tb_s": nbytes / seconds / 1e12,
                    "rel_err": err,
                }
            )
        except Exception as e:  # a variant that does not compile is reported, not fatal
            rows.append({"variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        print(json.dumps(rows[-1]), flush=True)
    print(f"read ceiling {ceiling / 1e12:.2f} TB/s")
    print(f"{'variant':58s} {'us/layer':>9s} {'TB/s':>6s} {'err':>8s}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:58s} ERROR {r['error'][:120]}")
        else:
            err = r["rel_err"] or 0.0
            print(f"{r['variant']:58s} {r['us_per_layer']:9.1f} {r['tb_s']:6.2f} {err:8.1e}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "quantized_matmul_probe.json"), "w") as fh:
            json.dump({"ceiling_tb_s": ceiling / 1e12, "rows": rows}, fh)


if __name__ == "__main__":
    sys.exit(main())
