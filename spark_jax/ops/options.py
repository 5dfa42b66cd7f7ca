"""Which kernels the attention and LayerNorm dispatch may pick, as one frozen value.

A model holds one ``KernelOptions`` and passes it to every step as a static jit argument, so
two models with different options compile different programs side by side: nothing is read
from module state at trace time, and no cache ever needs clearing to change a choice.
"""

from __future__ import annotations

from dataclasses import dataclass

from jax.sharding import Mesh

IMPLEMENTATIONS = (None, "xla", "cudnn", "pallas")


@dataclass(frozen=True)
class KernelOptions:
    """The dispatch's choices and our kernels' tunings (every default measured on the H200).

    ``implementation``: None lets the dispatch pick per call (cuDNN for a decode step on the
    GPU, the one-query kernel for an MHA step over a short cache, our flash kernel for a
    prefill on Hopper, else XLA's reference); "xla" forces the jnp reference everywhere,
    "cudnn" and "pallas" force those kernels (and raise where a forced kernel cannot run a
    plain ``attention`` call). For checks of one path against another.

    ``flash_prefill``: our flash kernel for prefill on Hopper in the default dispatch. A 4 x
    2048 prefill went 268 -> 186 ms (95% of the matmul rate); with the kernels shared per
    configuration (one compiled copy for all layers) an 8B engine's warm-up stays ~32 s.
    False keeps XLA's reference for prefill.

    ``paged_flash_prefill``: with ``flash_prefill``, a chunk of queries over a paged cache (the
    engine's prefills, which append to their rows' pages) runs the flash kernel over the pool
    in place (a TMA copy per page into each key block) instead of over a copy of every row's
    pages gathered first. Bitwise the same output; on the H200 no faster at a cached wave's
    shapes (8 rows of 72 queries after 1 000 keys, a 128-page table: 0.061 against 0.064 ms a
    layer padded to 640, 0.077 against 0.067 at 576; ``benchmarks/paged_prefill_probe.py``),
    so off: the gather is cheap beside the prefill's matmuls.

    ``ragged_query_blocks``: how a ragged prefill appending to the cache (the serving
    engine's) lays its queries out for attention. In blocks: rows of 128 queries (a chunk of
    n queries takes ceil(n / 128) rows, each seeing its row's cache up to its last query, so
    N tokens over R chunks fill about N + 127 R places), read by the flash kernel over the
    pages in place. By chunk: one row per chunk as long as the stream (R x N places, most of
    them padding that the layout's copies and the kernel's tiles still pay for). None takes
    blocks where the flash kernel reads a paged cache in place (Hopper, no window, a
    bf16/f16 cache), 0 one row per chunk everywhere, n > 0 rows of n queries everywhere
    (elsewhere they read gathered rows, one copy of a chunk's pages per block: for checks of
    one layout against the other). On the H200 (Llama-3-8B shapes, ``benchmarks/
    decode_step_probe.py --attention chunk_rows query_blocks``) a cached wave's prefill (8
    chunks of 72 after 1 000 cached keys, a stream of 576) went 17.07 -> 15.40 ms, a C=64
    step admitting 4 prompts of 224 beside 64 decode rows (1 024) 24.25 -> 23.54: no copy of
    the rows' pages, fewer and tuned kernel tiles.

    ``flash_decode_min_programs``: a one-token step with at least this many (row, kv head)
    programs walks its keys through the flash kernel (B=64, K=8: 2.55-4.17 TB/s against the
    split-K kernel's 1.42-2.92); fewer leave SMs idle (B=1, K=8: 0.07-0.11 TB/s against
    0.16-0.18), where the keys are split instead.

    ``one_query_max_keys``: the one-query kernel (Triton) takes an MHA decode step over at most
    this many cache positions: at NLLB-600M's step the 24 attentions went 284 -> 152-162 us
    at 32 rows and 590 -> 224-234 us at 128 rows against cuDNN. It walks each row's keys in
    one program, so a long cache over few rows would leave the GPU idle: past this many
    positions the split kernels keep the step.

    ``paged_walk_stages`` / ``paged_walk_consumers``: the paged flash walk's copies (one per
    page) issued by one producer warpgroup into 3 slots: 3.50 TB/s against 3.37 with the
    kernel's defaults, the dense walk 3.53 (B=64, 16-key pages). The interpreter keeps the
    kernel's defaults (warpgroups are threads there: slow).

    ``pallas_layer_norm``: our one-kernel LayerNorm on the GPU (bf16/f16). XLA's is two
    kernels (statistics, then the affine), which NLLB-600M's launch-bound decode step pays 37
    times.

    ``pallas_quantized_matmul``: a quantized model's matmuls (fp8 / int8 weights, one scale per
    output channel) over up to ``quantized_matmul_max_rows`` rows run our split-K kernel on the
    GPU (``pallas_kernels/quantized_matmul.py``); XLA's GEMM with the convert fused reaches
    ~1.2 TB/s at one row. Llama-3-8B shapes, bs=1: fp8 274 tok/s with it against 203 without
    (bf16 224); at 64 rows XLA's GEMM was the faster (fp8 7 360 against 6 610 tok/s), so it
    keeps more than 16 rows. ``implementation="xla"`` keeps the jnp reference too.

    ``pallas_fp8_cache``: a decode step over an fp8 K/V cache reads the E4M3 pages in place
    with our kernel on the GPU (``pallas_kernels/scaled_paged_attention.py``) instead of XLA's
    fallback (rows dequantized, then its split-K form). Llama-3-8B shapes, 64 rows x 4,096
    keys on the H200: 5 814 tok/s with it, 591 without, bf16 cache 5 050.

    ``mesh``: a tensor-parallel model's one-axis ("tp") mesh. Attention then runs per shard
    under ``shard_map`` (each device its own query and KV heads, through the same dispatch, so
    cuDNN's and our kernels see whole heads); ``implementation="xla"`` leaves it to XLA's SPMD
    partitioner. The quantized matmul and LayerNorm kernels are not used under it (their
    operands are sharded along what the kernels sum, or replicated).
    """

    implementation: str | None = None
    flash_prefill: bool = True
    paged_flash_prefill: bool = False
    ragged_query_blocks: int | None = None
    flash_decode_min_programs: int = 256
    one_query_max_keys: int = 256
    paged_walk_stages: int = 3
    paged_walk_consumers: int = 1
    pallas_layer_norm: bool = True
    pallas_quantized_matmul: bool = True
    pallas_fp8_cache: bool = True
    mesh: Mesh | None = None
    quantized_matmul_max_rows: int = 16

    def __post_init__(self) -> None:
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"unknown implementation {self.implementation!r}: None (the dispatch picks), "
                "'xla', 'cudnn' or 'pallas'"
            )
        if not 2 <= self.paged_walk_stages <= 8:
            raise ValueError(f"paged_walk_stages is {self.paged_walk_stages}: give 2 to 8")
        if self.ragged_query_blocks is not None and self.ragged_query_blocks < 0:
            raise ValueError(
                f"ragged_query_blocks is {self.ragged_query_blocks}: give None (the dispatch "
                "picks), 0 (a row per chunk) or the queries per row"
            )
        if self.paged_walk_consumers not in (0, 1):  # the decode walk's one 64-row block
            raise ValueError(f"paged_walk_consumers is {self.paged_walk_consumers}: give 0 or 1")
