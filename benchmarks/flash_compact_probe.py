"""Probe (kept out of the suites): the flash prefill kernel on a ragged batch's rows layout, its
persistent programs walking only the tiles with a live query against walking every tile.

    PYTHONPATH=. python benchmarks/flash_compact_probe.py

The engine's ragged prefill hands attention its rows as [R, N]: each of R rows spans the
whole flat stream of N tokens, so most tiles hold only padding. Shapes of Llama-3-8B (32 query
heads, 8 kv heads, head dim 128), R = 8: a C=64 prefill step (N = 1024, ~1 000 tokens over 6
fresh prompts, keys = the rows' gathered 2 048) and a cached wave (N = 640, 8 questions of 72
tokens after a 1 000-token prefix). Per shape: the device's time per call
(``back_to_back_seconds``) with and without the walk over live tiles only (the kernel's
``_COMPACT_ROWS`` set to 0 for the latter), and their largest difference in output.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import back_to_back_seconds
from pallas_kernels import flash_attention as fa

SHAPES = {  # name: (N, S, query lengths, key lengths)
    "c64_prefill_step": (
        1024, 2048, [230, 150, 310, 120, 140, 50, 0, 0], [230, 150, 310, 120, 140, 50, 0, 0],
    ),
    "cached_wave": (640, 2048, [72] * 8, [1072] * 8),
}  # fmt: skip


def _timed(q, k, v, lengths, tuning) -> tuple[float, jax.Array]:
    """(ms per call on the device, the output) of the kernel as it is built now."""
    run = jax.jit(lambda q, k, v, ql, kl: fa.flash_attention(q, k, v, ql, kl, **tuning))
    out = run(q, k, v, *lengths)
    return back_to_back_seconds(lambda: run(q, k, v, *lengths), 20) * 1e3, out


def main() -> None:
    rng = np.random.default_rng(0)
    results, compact_rows = {}, fa._COMPACT_ROWS
    for name, (t, s, q_len, k_len) in SHAPES.items():
        q = jnp.asarray(rng.standard_normal((8, t, 32, 128)), jnp.bfloat16)
        k, v = (jnp.asarray(rng.standard_normal((8, s, 8, 128)), jnp.bfloat16) for _ in "kv")
        lengths = jnp.asarray(q_len, jnp.int32), jnp.asarray(k_len, jnp.int32)
        tuning = fa.prefill_tuning(q, k, interpret=False)
        row = {}
        for label, rows in (("live tiles", compact_rows), ("every tile", 0)):
            fa._COMPACT_ROWS = rows
            fa._flash_kernel.cache_clear()
            row[label] = _timed(q, k, v, lengths, tuning)
        fa._COMPACT_ROWS = compact_rows
        diff = jnp.max(jnp.abs(row["live tiles"][1] - row["every tile"][1]).astype(jnp.float32))
        results[name] = {
            "live_tiles_ms": row["live tiles"][0],
            "every_tile_ms": row["every tile"][0],
            "max_abs_difference": float(diff),
        }
        print(name, json.dumps(results[name]), flush=True)


if __name__ == "__main__":
    main()
