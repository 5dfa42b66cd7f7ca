"""Startup of a serving engine on Llama-3-8B shapes: load + compile of every shape + first token.

    python -m benchmarks startup           # on the H200 (~2 minutes, 16 GB on disk)
    python -m benchmarks startup --tiny    # a tiny config on any backend

From nothing in memory to the first token, every step shape the engine can
run compiled on the way (``Engine.warmup``), within 60 s. The run first writes random bf16
weights as a converted model directory (orbax params + config.json, what
``conversion.hf_to_orbax`` writes), then times, in this order and in one process with no
persistent compilation cache (a cold start):

- ``read_s``: a plain sequential read of the checkpoint's files (the floor of the load: the
  same bytes at the rate this disk and page cache deliver them, measured in the same run),
- ``load_s``: ``sj.load`` to parameters resident on the device,
- ``engine_s``: ``sj.Engine(...)`` (page pool and host state),
- ``warmup_s``: ``Engine.warmup`` (every decode width and prefill shape, the sampler),
- ``first_token_s``: one 128-token prompt from ``add_request`` to its first token.

The engine is the serving suite's (128 slots, 16-token pages, max_model_len 2048, chunks
256-1024). The peer is ``read_s``, the floor of the load; the target is 60 s in all.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from benchmarks.common import Report, hf_llama_kwargs, random_params
from benchmarks.serving import FULL, SMALL, Plan
from spark_jax.checkpoint import PARAMS_DIR, save_params

TARGET_S = 60.0


def write_model(plan: Plan, path: Path) -> int:
    """A converted model directory of random weights; returns its bytes on disk."""
    params = random_params(plan.config, plan.dtype)
    save_params(path / PARAMS_DIR, params)
    del params
    config = hf_llama_kwargs(plan.config, model_type="llama", torch_dtype=plan.dtype)
    config["architectures"] = ["LlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def read_files(path: Path) -> float:
    """Seconds to read every file under ``path`` once, sequentially, in 64 MiB blocks."""
    start = time.perf_counter()
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with f.open("rb", buffering=0) as handle:
                while handle.read(64 << 20):
                    pass
    return time.perf_counter() - start


def cold_start(plan: Plan, path: Path) -> dict[str, Any]:
    """Times load, engine creation, warm-up and the first token, in that order."""
    import spark_jax as sj

    times: dict[str, Any] = {}
    start = time.perf_counter()
    model = sj.load(path, dtype=plan.dtype)
    jax.block_until_ready(model.params)
    times["load_s"] = time.perf_counter() - start

    mark = time.perf_counter()
    engine = sj.Engine(model, **plan.engine_kwargs())
    times["engine_s"] = time.perf_counter() - mark

    mark = time.perf_counter()
    engine.warmup()
    times["warmup_s"] = time.perf_counter() - mark

    mark = time.perf_counter()
    prompt = np.random.default_rng(0).integers(0, plan.config.vocab_size, 128).tolist()
    engine.add_request(prompt, sj.SamplingParams(temperature=0.0, max_tokens=1))
    outputs = []
    while not outputs:
        outputs = [o for o in engine.step() if o.new_token_ids]
    times["first_token_s"] = time.perf_counter() - mark
    times["total_s"] = time.perf_counter() - start
    return times


def run(tiny: bool, peer: bool = True) -> Report:
    """The plain read of the checkpoint is this suite's peer (the load's floor): always run."""
    plan = SMALL if tiny else FULL
    results: dict[str, Any] = {"target_s": TARGET_S}
    root = Path(tempfile.mkdtemp(prefix="spark_jax_startup_"))
    try:
        mark = time.perf_counter()
        results["checkpoint_bytes"] = write_model(plan, root)
        results["write_s"] = time.perf_counter() - mark
        results["read_s"] = read_files(root)
        results |= cold_start(plan, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = Report(details=results)
    report.figures = {k: results[k] for k in ("total_s", "load_s", "warmup_s", "first_token_s")}
    report.peers = {"read_s": results["read_s"], "target_s": TARGET_S}
    report.ratios = {
        "read_over_load": results["read_s"] / results["load_s"],
        "target_over_total": TARGET_S / results["total_s"],
    }
    keys = ["read_s", "load_s", "engine_s", "warmup_s", "first_token_s", "total_s"]
    report.table = [["stage", "seconds"], *[[k, results[k]] for k in keys]]
    return report
