"""Probe (kept out of the suites): where a bare serving step's time goes, kernel by kernel,
beside its read floor, for the decode step and for the ragged prefill the engine runs.

    PYTHONPATH=. python benchmarks/decode_step_probe.py [--rows 1 64] [--context 300 2000]
        [--attention default pallas chunk_rows query_blocks] [--xla default no_triton_gemm]
        [--prefill cached_wave cached_wave_alone c64_step] [--hlo] [--tiny]

Builds the serving engine's ``PagedExecutor`` over a random Llama-3-8B (no warm-up of the
other programs) and a pool of the suite's size (``gpu_memory_utilization``: cuDNN's paged
attention, which needs rows x table-width pages, then takes the widths it takes there).
Decode, per (rows, context): the device's time a step of the decoder's decode program (the
engine's forward at that width) dispatched back to back, the rows' lengths copied back
before each step, its floor (the weights and the rows' K/V read once at the read ceiling
measured in this run), and a trace of ``--traced`` steps: each kernel's time a step,
largest first. ``--prefill`` does the same for ragged prefill steps (the
decoder's ``prefill``, ragged, as the engine's ``prefill_returning_inputs`` runs it; the
lengths copied back each call too): ``cached_wave``, 8 rows of 72 new tokens
after 1 000 cached keys in a stream of 576, with the 256-slot engine's decode rows riding
(none real), as the shared-prefix level's waves run; ``cached_wave_alone`` the same without
riding rows; ``c64_step``, 4 fresh prompts of 224 tokens and 64 decode rows at 300 keys in a
stream of 1 024, a C=64 step that admits; ``one_chunk_step`` and ``later_chunk_step`` one
chunk of 128 prompt tokens (a prompt's first, or after 128 cached) beside the same 64 decode
rows in a stream of 256, the step a cap of tokens a step makes. ``--xla`` compiles each
program once per set of XLA options over the step's own (``default``: cuBLAS's GEMMs from 64 rows,
``spark_jax.models.wide_gemm``; ``triton_gemm``: XLA's Triton fusions at any width;
``no_triton_gemm``: cuBLAS at any width). ``--attention pallas`` forces our
paged kernels (``KernelOptions.implementation``), ``no_flash_prefill`` XLA's attention for
prefills (``KernelOptions.flash_prefill=False``), ``split_decode`` the split-K paged kernel
for every one-token attention our kernels take (a mixed step's riding rows; the flash walk
pads each row's queries to 64); ``chunk_rows`` lays a prefill's queries
out one attention row per chunk, ``query_blocks`` in rows of 128 where the flash kernel reads
the pages in place (``KernelOptions.ragged_query_blocks`` 0 and None). With ``$OUT`` set,
the figures go to ``$OUT/decode_step_probe.json``, and under ``--hlo`` each program's
optimized HLO to ``$OUT/hlo_<program>.txt.gz`` (what each traced fusion holds).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    back_to_back_seconds,
    kv_bytes_per_token,
    prefill_flops,
    random_params,
    read_bandwidth,
    weight_bytes_per_step,
)
from benchmarks.serving import FULL, SMALL, device_kernels, merged_gaps
from spark_jax.models import decoder
from spark_jax.ops.options import KernelOptions
from spark_jax.serving.engine import pages_that_fit
from spark_jax.serving.executor import PagedExecutor, upload

ATTENTION = {
    "default": KernelOptions(),
    "pallas": KernelOptions(implementation="pallas"),
    "chunk_rows": KernelOptions(ragged_query_blocks=0),
    "query_blocks": KernelOptions(ragged_query_blocks=None),
    "no_flash_prefill": KernelOptions(flash_prefill=False),
    "split_decode": KernelOptions(flash_decode_min_programs=1 << 30),
}
# "default": the step's own (``spark_jax.models.wide_gemm``: cuBLAS's GEMMs from 64 rows).
XLA_OPTIONS = {
    "default": {},
    "triton_gemm": {"xla_gpu_enable_triton_gemm": True},
    "no_triton_gemm": {"xla_gpu_enable_triton_gemm": False},
}
# name: (prefill rows, new tokens a row, cached keys a row, stream length, real decode rows
# and their keys, decode slots riding (None: a program without them))
PREFILLS = {
    "cached_wave": (8, 72, 1000, 576, 0, 300, 256),
    "cached_wave_alone": (8, 72, 1000, 576, 0, 300, None),
    "c64_step": (4, 224, 0, 1024, 64, 300, 256),
    "one_chunk_step": (1, 128, 0, 256, 64, 300, 256),
    "later_chunk_step": (1, 128, 128, 256, 64, 300, 256),
}
TINY_PREFILLS = {
    "cached_wave": (4, 8, 40, 64, 0, 20, 8),
    "cached_wave_alone": (4, 8, 40, 64, 0, 20, None),
    "c64_step": (2, 16, 0, 64, 4, 20, 8),
    "one_chunk_step": (1, 16, 0, 32, 4, 20, 8),
    "later_chunk_step": (1, 16, 16, 32, 4, 20, 8),
}


def kernels_of_trace(trace_dir: str, calls: int) -> dict[str, Any]:
    """Each device kernel's time a call (ms), and the merged busy and idle time a call."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    kernels = device_kernels(jax.profiler.ProfileData.from_file(paths[0]))
    by_name: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for start, end, name, _ in kernels:
        by_name[name[:90]] += end - start
        counts[name[:90]] += 1
    spans = [(start, end, "step") for start, end, _, _ in kernels]
    if not spans:
        return {"error": "no device events (a CPU backend)"}
    busy, _, _ = merged_gaps(spans)
    span = max(b for _, b, _ in spans) - min(a for a, _, _ in spans)
    return {
        "busy_ms_per_call": busy / calls / 1e6,
        "idle_ms_per_call": (span - busy) / calls / 1e6,
        "kernels_per_call": sum(counts.values()) / calls,
        "top_kernels_ms_per_call": {
            f"{name} (x{counts[name] / calls:g})": ns / calls / 1e6
            for name, ns in by_name.most_common(30)
        },
    }


def measured(call: Callable[[], Any], traced: int) -> dict[str, Any]:
    """``call``'s device time back to back, and a trace of ``traced`` calls."""
    seconds = back_to_back_seconds(call, calls=10)
    jax.block_until_ready(call())
    trace_dir = tempfile.mkdtemp()
    jax.profiler.start_trace(trace_dir)
    for _ in range(traced):
        out = call()
    jax.block_until_ready(out)
    jax.profiler.stop_trace()
    return {"ms": seconds * 1e3} | kernels_of_trace(trace_dir, traced)


class Programs:
    """One executor's state and the decode and prefill programs over it, compiled with the
    given XLA options (static arguments dropped from the compiled calls)."""

    def __init__(self, executor: PagedExecutor, xla: dict[str, Any]):
        self.executor, self.xla = executor, xla
        self.runner = executor.runner
        self.hlo = ""  # the optimized HLO of the program built last

    def table(self, rows: int, keys: int, first_page: int = 0) -> tuple[np.ndarray, int]:
        """A block table whose first ``rows`` rows own pages for ``keys`` keys each."""
        ex = self.executor
        table = np.full((ex.num_slots, ex.width_ladder[-1]), ex.num_pages, np.int32)
        used = -(-keys // ex.state.page_size)
        pages = first_page + np.arange(rows * used).reshape(rows, used)
        table[:rows, :used] = pages
        return table, first_page + rows * used

    def decode(self, rows: int, context: int) -> Callable[[], Any]:
        """A call of ``rows`` decode rows at ``context`` keys (the lengths reset each call)."""
        ex = self.executor
        table, _ = self.table(rows, context + 16)
        tokens, active = upload(np.zeros((rows,), np.int32)), upload(np.ones((rows,), bool))
        lengths = upload(np.full((rows,), context, np.int32))
        ex.state = ex.state.with_block_table(upload(table[:rows])).with_lengths(lengths)
        args, _ = self.runner._decode_args(ex.state, tokens, active, None, False)
        compiled = decoder.decode.lower(*args, options=self.runner.options).compile(self.xla)
        self.hlo = compiled.as_text()

        def call() -> Any:  # a copy of the lengths each call: the step donates them
            st = ex.state.with_lengths(jnp.copy(lengths))
            logits, ex.state = compiled(args[0], tokens, active, st, args[5])
            return logits

        return call

    def prefill(self, shape: tuple) -> Callable[[], Any]:
        """A ragged prefill call of ``shape`` (``PREFILLS``'s), lengths reset each call."""
        ex, rows, new, cached, stream, decoding, decode_keys, riding = (self.executor, *shape)
        table, next_page = self.table(rows, cached + new)
        decode_table, _ = self.table(decoding, decode_keys + 16, next_page)
        table[rows : rows + decoding] = decode_table[:decoding]
        lengths = np.zeros((ex.num_slots,), np.int32)
        lengths[:rows], lengths[rows : rows + decoding] = cached, decode_keys
        lengths = upload(lengths)
        state = ex.state.with_block_table(upload(table))
        tokens = np.zeros((stream,), np.int32)
        tokens[: rows * new] = 7
        mixed: tuple = (None, None)
        if riding is not None:
            slots = np.full((riding,), ex.num_slots, np.int32)
            slots[:decoding] = np.arange(rows, rows + decoding)
            mixed = (upload(slots), upload(np.zeros((ex.num_slots,), np.int32)))
        inputs = (
            upload(tokens),
            upload(np.full((rows,), new, np.int32)),
            upload(np.arange(rows, dtype=np.int32)),
        )
        params, lora, options = self.runner.params, None, self.runner.options
        lowered = decoder.prefill.lower(
            params, self.runner.config, *inputs, state.with_lengths(lengths), False, lora,
            *mixed, options=options, ragged=True,
        )  # fmt: skip
        compiled = lowered.compile(self.xla)
        self.hlo = compiled.as_text()
        ex.state = state

        def call() -> Any:
            st = ex.state.with_lengths(jnp.copy(lengths))
            logits, ex.state = compiled(params, *inputs, st, lora, *mixed)
            return logits

        return call


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[300])
    parser.add_argument("--traced", type=int, default=5, help="calls in each trace")
    parser.add_argument(
        "--attention",
        nargs="+",
        default=["default"],
        choices=sorted(ATTENTION),
        help="the dispatch's pick, our paged kernels forced, or a prefill's attention rows one "
        "per chunk or in blocks of 128 (KernelOptions.ragged_query_blocks 0 or None)",
    )
    parser.add_argument("--xla", nargs="+", default=["default"], choices=sorted(XLA_OPTIONS))
    parser.add_argument("--prefill", nargs="*", default=[], choices=sorted(PREFILLS))
    parser.add_argument("--hlo", action="store_true", help="each program's HLO under $OUT")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    plan = SMALL if args.tiny else FULL
    c = plan.config
    import spark_jax as sj

    params = random_params(c, plan.dtype)
    page, max_pages = plan.page_size, plan.max_model_len // plan.page_size
    slots = max(max(args.rows), 256 if not args.tiny else 16)
    pages = max(args.rows) * min(max_pages, -(-(max(args.context) + 300) // page)) + 4096
    if plan.gpu_memory_utilization is not None:  # the suite's pool: its kernels at each width
        itemsize = np.dtype(plan.dtype).itemsize
        fit = pages_that_fit(
            c, itemsize, plan.gpu_memory_utilization, page, plan.max_batch_tokens, slots
        )
        pages = max(pages, fit)
    read = read_bandwidth(16 << 20 if args.tiny else 4 << 30)
    results: dict[str, Any] = {"read_bytes_per_s": read, "device": str(jax.devices()[0])}
    prefills = TINY_PREFILLS if args.tiny else PREFILLS

    def report(name: str, figures: dict[str, Any], hlo: str, floor: float | None = None) -> None:
        if floor:
            figures |= {"floor_ms": floor * 1e3, "over_floor": figures["ms"] / 1e3 / floor}
        results[name] = figures
        extra = f", floor {floor * 1e3:.3f} ms" if floor else ""
        print(f"{name}: {figures['ms']:.3f} ms a call{extra}", flush=True)
        out = os.environ.get("OUT")
        if out:  # after each program: a call cut short keeps what it has
            with open(os.path.join(out, "decode_step_probe.json"), "w") as f:
                json.dump(results, f, indent=1)
            if args.hlo:
                file = "hlo_" + "_".join(name.replace("=", "").split()) + ".txt.gz"
                with gzip.open(os.path.join(out, file), "wt") as f:
                    f.write(hlo)

    for attention in args.attention:
        options = ATTENTION[attention]
        model = sj.Model(c, params, options=options)
        executor = PagedExecutor(
            model, slots, pages, page, max_pages, [max_pages], sorted(set(args.rows)), 8
        )
        for xla in args.xla:
            programs = Programs(executor, XLA_OPTIONS[xla])
            for rows in args.rows:
                for context in args.context:
                    kv = rows * context * kv_bytes_per_token(c)
                    floor = (weight_bytes_per_step(c) + kv) / read
                    figures = measured(programs.decode(rows, context), args.traced)
                    name = f"decode {attention} {xla} rows={rows} ctx={context}"
                    report(name, figures, programs.hlo, floor)
            for name in args.prefill:
                rows, new, cached = prefills[name][:3]
                figures = measured(programs.prefill(prefills[name]), args.traced)
                figures["tflop_s"] = rows * prefill_flops(c, 1, new) / figures["ms"] * 1e-9
                report(f"prefill {name} {attention} {xla}", figures, programs.hlo)
            jax.clear_caches()
        del executor, model
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
