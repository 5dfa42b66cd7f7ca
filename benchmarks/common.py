"""What the suites share: device timing, ceilings, shapes, random models, options and output.

Timing: JAX work is timed only after a device sync (``median_seconds``), as a chain of calls
dispatched back to back with one sync (``chain_seconds``), or as the device's time per call
with a chain's fixed cost taken out (``back_to_back_seconds``); torch peers with CUDA events
(``torch_median_seconds``). Ceilings are measured in the same run (``copy_bandwidth``,
``read_bandwidth``, ``matmul_rate``). Nothing here imports torch at module level: torch peers
run in a process of their own (``peer_in_subprocess``) so JAX and torch never share the GPU.

Options: ``kernel_options`` / ``loop_options`` give the keyword arguments that select
non-default kernels or loops through the public API. An older checkout without the options
classes (``--against``) measures the defaults only; a suite records what it had to skip.

Output: every suite returns a ``Report``; ``finish`` prints it as one JSON line, then a table.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from spark_jax.config import ModelConfig, RopeConfig

REPO = Path(__file__).resolve().parent.parent
HBM_BYTES_PER_S = 4.3e12  # the H200's nominal bandwidth, bytes read + written
State = TypeVar("State")


class Unsupported(Exception):
    """The tree under test lacks what a measurement needs (an option, a GPU, torch)."""


# ---------------------------------------------------------------------------------------------
# Shapes.

LLAMA3_ROPE = RopeConfig(
    theta=500000.0,
    kind="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
LLAMA3_8B = ModelConfig(
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope=LLAMA3_ROPE,
    max_position_embeddings=131072,
)
TINY_LLAMA = dataclasses.replace(
    LLAMA3_8B,
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
)


def llama(tiny: bool) -> tuple[ModelConfig, str]:
    """(config, dtype) of a suite: Llama-3-8B in bf16, or the tiny stand-in in fp32 (the CPU
    backend has no bf16 x bf16 -> f32 batched dot)."""
    return (TINY_LLAMA, "float32") if tiny else (LLAMA3_8B, "bfloat16")


def hf_llama_kwargs(config: ModelConfig, **overrides: Any) -> dict[str, Any]:
    """``transformers.LlamaConfig`` keyword arguments of the same model (the torch peers')."""
    rope = config.rope
    kwargs = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        rope_parameters={
            "rope_type": rope.kind,
            "rope_theta": rope.theta,
            "factor": rope.factor,
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        },
    )
    return kwargs | overrides


def weight_bytes_per_step(config: ModelConfig, itemsize: int = 2) -> int:
    """Weights a decode step reads: all but the embedding table (it gathers B rows of it)."""
    return (config.num_params - config.vocab_size * config.hidden_size) * itemsize


def kv_bytes_per_token(config: ModelConfig, itemsize: int = 2) -> int:
    """K and V of one position over all layers."""
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * itemsize


def prefill_flops(config: ModelConfig, batch: int, length: int) -> float:
    """Matmul FLOPs of a causal prefill: projections of every token, the causal half of
    attention, and the LM head of the last token of each row."""
    d, f = config.hidden_size, config.intermediate_size
    per_token = config.num_layers * 2 * (d * config.qkv_size + config.q_size * d + 3 * d * f)
    attention = config.num_layers * batch * 2 * length * length * config.q_size
    return per_token * batch * length + attention + 2 * batch * d * config.vocab_size


def random_prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` random token ids."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length).tolist() for _ in range(count)]


# ---------------------------------------------------------------------------------------------
# Models and options through the public API.


def random_params(config: Any, dtype: str, seed: int = 0) -> Any:
    """Random weights of the config's family, as ``init_params`` draws them."""
    try:
        from spark_jax.models import family
    except ImportError:  # a tree from before the family interface
        from spark_jax.models import decoder

        return decoder.init_params(config, jax.random.key(seed), dtype)
    return family(config).init_params(config, jax.random.key(seed), dtype)


def has_options() -> bool:
    """Whether the tree under test takes options objects (KernelOptions, LoopOptions): read
    off the files of the spark_jax actually imported (an editable install elsewhere could
    otherwise lend an older tree the newer tree's modules)."""
    import spark_jax

    root = Path(spark_jax.__file__).parent
    return (root / "ops" / "options.py").is_file() and (root / "generation" / "step.py").is_file()


def kernel_options(**fields: Any) -> dict[str, Any]:
    """``sj.Model`` / ``sj.load`` / attention keyword arguments selecting these kernel options;
    ``{}`` for the defaults, so a tree without the options runs the very same call."""
    if not fields:
        return {}
    if not has_options():
        raise Unsupported(f"this tree has no KernelOptions ({fields} not measurable)")
    from spark_jax.ops.options import KernelOptions

    return {"options": KernelOptions(**fields)}


def loop_options(**fields: Any) -> dict[str, Any]:
    """``sj.generate_batch`` / ``sj.generate_beam`` keyword arguments selecting these loop
    options; ``{}`` for the defaults."""
    if not fields:
        return {}
    if not has_options():
        raise Unsupported(f"this tree has no LoopOptions ({fields} not measurable)")
    from spark_jax.generation.step import LoopOptions

    return {"loop": LoopOptions(**fields)}


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


# ---------------------------------------------------------------------------------------------
# Timing (JAX).


# While a profile is active XLA runs each program's kernels one by one unless told otherwise,
# not as the CUDA graph it runs them as unprofiled (``profile_as_run``).
PROFILE_AS_RUN_FLAG = "--xla_enable_command_buffers_during_profiling=true"


def add_xla_flag(flag: str) -> None:
    """Adds ``--name=value`` to ``XLA_FLAGS`` unless a value of that name is set there already
    (the user's stays). Takes effect only before jax starts its backend."""
    flags = os.environ.get("XLA_FLAGS", "")
    if flag.split("=")[0] not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


def profile_as_run() -> None:
    """Profiles taken in this process trace the programs as they run unprofiled, each a CUDA
    graph (XLA's command buffer), not kernel by kernel: the serving suite's device idle is
    then the idle of the engine users run. On an H100 the same probe of the C=64 level (one
    decode step a call) read 3.3% idle between programs kernel by kernel and 2.5% as
    graphs. Takes effect only before jax starts its backend: call it first thing."""
    add_xla_flag(PROFILE_AS_RUN_FLAG)


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# A program loaded from the persistent compilation cache instead of compiled: jax records its
# retrieval time only on a hit.
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_retrieval_time_sec"


class CompileCounter:
    """Counts XLA programs built while active: backend compilations and persistent-cache hits
    (jax.monitoring's events), so a program counts whether or not another run compiled it.

    On the GPU every program built drops the command buffers (CUDA graphs) XLA recorded for
    all the others, to be recorded again on their next runs: a measurement that builds one
    between an engine's warm-up and its timed levels slows their first steps."""

    def start(self) -> CompileCounter:
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def stop(self) -> int:
        """Stops counting; the count."""
        jax.monitoring.unregister_event_duration_listener(self._listen)
        return self.count

    def _listen(self, event: str, duration: float, **kwargs: object) -> None:
        self.count += event in (COMPILE_EVENT, CACHE_HIT_EVENT)

    def __enter__(self) -> CompileCounter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def median_seconds(fn: Callable[[], Any], warmup: int = 3, iters: int = 10) -> float:
    """Median wall time of ``fn()`` with the device synced after every call."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def chain_seconds(
    step: Callable[[State], State], state: State, steps: int, repeats: int = 3, warmup: int = 2
) -> tuple[float, list[float], State]:
    """Seconds per step of ``state = step(state)`` dispatched back to back, one sync per repeat.

    Returns the median over repeats of (repeat time / steps), every repeat's figure and the
    final state (the steps may donate their input, so the caller must use the returned one).
    """
    for _ in range(warmup):
        state = step(state)
    jax.block_until_ready(state)
    per_step = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            state = step(state)
        jax.block_until_ready(state)
        per_step.append((time.perf_counter() - start) / steps)
    return statistics.median(per_step), per_step, state


def back_to_back_seconds(
    fn: Callable[[], Any], calls: int, repeats: int = 5, warmup: int = 1
) -> float:
    """The device's time per call of ``fn()``, as CUDA events time a torch peer: the median
    over repeats of (a chain of 2 x ``calls`` - a chain of ``calls``) / ``calls``. The chain's
    fixed cost (first launch, final sync: ~150 us on the H200) would otherwise be 17% of ten
    90-us kernels."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    differences, longs = [], []
    for _ in range(repeats):
        short, _, _ = chain_seconds(lambda _: fn(), None, calls, repeats=1, warmup=0)
        long, _, _ = chain_seconds(lambda _: fn(), None, 2 * calls, repeats=1, warmup=0)
        differences.append(2 * long - short)  # (2n long - n short) / n
        longs.append(long)
    difference = statistics.median(differences)
    # Calls far shorter than the host's noise (tiny shapes on a busy CPU) can make the
    # difference zero or negative: the long chain's time per call is then the honest figure.
    return difference if difference > 0 else statistics.median(longs)


def host_median_seconds(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """(median wall time, last result) of ``fn()``, whose result is already on the host (the
    public generation calls return lists of ids); the caller warms it up first."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(result, seconds) of one call, synced: for compile and first-call times."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# Ceilings measured in the run.


def copy_bandwidth(nbytes: int = 4 << 30, iters: int = 10) -> float:
    """Device memory bandwidth in bytes/s of an elementwise pass (bytes read + written)."""
    x = jax.random.normal(jax.random.key(1), (nbytes // 4,), jnp.float32)
    touch = jax.jit(lambda a: a * 1.0001)
    return 2 * nbytes / back_to_back_seconds(lambda: touch(x), calls=iters)


def read_bandwidth(nbytes: int = 4 << 30, iters: int = 10) -> float:
    """Bytes/s of a read-only pass (a sum: nothing written back), the ceiling of a decode
    step, which reads weights and cache and writes almost nothing."""
    x = jax.random.normal(jax.random.key(3), (nbytes // 2,), jnp.bfloat16)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    return nbytes / back_to_back_seconds(lambda: total(x), calls=iters)


def matmul_rate(n: int = 8192, iters: int = 10) -> float:
    """bf16 matrix product rate in FLOP/s on random [n, n] operands (fp32 accumulation)."""
    ka, kb = jax.random.split(jax.random.key(2))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    product = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    return 2 * n**3 / back_to_back_seconds(lambda: product(a, b), calls=iters)


def ceilings(tiny: bool) -> dict[str, float]:
    """Copy, read and matmul ceilings of this device in this run (small sizes when tiny),
    each the device's time per call of a chain (``back_to_back_seconds``): a host sync around
    each call read the H200's 4 GiB sum at 2.49 TB/s, below the 3.65 TB/s a bs=1 decode step
    reads its weights at, and made a roofline the engine beat."""
    nbytes, n = (16 << 20, 256) if tiny else (4 << 30, 8192)
    return {
        "copy_bytes_per_s": copy_bandwidth(nbytes),
        "read_bytes_per_s": read_bandwidth(nbytes),
        "matmul_flop_s": matmul_rate(n),
    }


# ---------------------------------------------------------------------------------------------
# Torch peers (imported lazily, run in a process of their own).


def torch_median_seconds(fn: Callable[[], Any], warmup: int = 3, iters: int = 10) -> float:
    """Median time of ``fn()`` measured with CUDA events (host clock on a CPU torch)."""
    import torch

    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) / 1e3 for start, end in events)


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def peer_in_subprocess(suite: str, tiny: bool, timeout_s: float, arg: str = "") -> dict[str, Any]:
    """Runs ``python -m benchmarks <suite> --peer-json ...`` (the suite's ``peer``) before this
    process touches the GPU; returns its JSON, or ``{"error": ...}``."""
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "peer.json")
        command = [sys.executable, "-m", "benchmarks", suite, "--peer-json", path]
        command += (["--tiny"] if tiny else []) + (["--peer-arg", arg] if arg else [])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *sys.path[:1]]))
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                command, cwd=REPO, env=env, timeout=timeout_s, capture_output=True, text=True
            )
        except subprocess.TimeoutExpired:
            return {"error": f"peer timed out after {timeout_s:.0f} s"}
        if proc.returncode != 0:
            return {"error": proc.stderr[-1500:]}
        results = json.loads(Path(path).read_text())
    results["process_s"] = time.perf_counter() - start
    return results


# ---------------------------------------------------------------------------------------------
# Output.


@dataclass
class Report:
    """What a suite measured. ``figures`` are ours (flat name -> number, compared across trees
    by ``--against``), ``peers`` the peers' and ceilings' from the same run, ``ratios`` ours
    over theirs (> 1: ours better), ``notes`` what was skipped and why, ``details`` the rest;
    ``table`` a header row then rows for the human table."""

    figures: dict[str, float] = field(default_factory=dict)
    peers: dict[str, float] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    table: list[list[Any]] = field(default_factory=list)


def tree_info() -> dict[str, Any]:
    """The spark_jax under test: its folder, commit and API generation."""
    import spark_jax

    folder = Path(spark_jax.__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"tree": str(folder), "commit": commit, "options_api": has_options()}


def result_line(suite: str, tiny: bool, report: Report, wall_s: float) -> dict[str, Any]:
    """The suite's JSON object: what ran where, and the report."""
    device = jax.devices()[0]
    return {
        "suite": suite,
        "tiny": tiny,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "device": str(device.device_kind),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        **tree_info(),
        "figures": report.figures,
        "peers": report.peers,
        "ratios": report.ratios,
        "notes": report.notes,
        "details": report.details,
        "wall_s": wall_s,
    }


def write_json(line: dict[str, Any], suite: str, out: str | None) -> Path:
    """Writes the JSON line to ``out`` (default: benchmarks/results/<suite>-<UTC time>.json)
    and to $OUT/<suite>.json when $OUT is set (the device machine's result folder)."""
    text = json.dumps(line, sort_keys=True, default=str) + "\n"
    if out is None:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
        out = str(REPO / "benchmarks" / "results" / f"{suite}-{stamp}.json")
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    device_out = os.environ.get("OUT")
    if device_out:
        (Path(device_out) / f"{suite}.json").write_text(text)
    return path


def write_probe_json(results: dict[str, Any], probe: str) -> None:
    """A probe's results as $OUT/<probe>.json when $OUT is set (the device machine's result
    folder, which comes back); nothing elsewhere (probes print their figures)."""
    device_out = os.environ.get("OUT")
    if device_out:
        (Path(device_out) / f"{probe}.json").write_text(json.dumps(results, indent=1))


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain fixed-width table; floats with 3 significant digits."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1e4 else f"{value:.0f}"
        return "-" if value is None else str(value)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)), flush=True)


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs where both are positive numbers, else None."""
    if not ours or not theirs or ours <= 0 or theirs <= 0:
        return None
    return ours / theirs
