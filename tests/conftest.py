"""Shared fixtures: session-scoped models built from ``helpers`` (the HF oracle and the same
weights as spark_jax models, the real SmolLM2)."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from pathlib import Path

# One persistent XLA compilation cache for the whole run, set before jax is imported: this file
# loads in pytest's main process first, so its xdist workers, the notebooks' kernels and the CLI
# children inherit the same directory, and a program two tests (or processes) build is compiled
# once. Compilation is most of the suite's CPU time. Counting helpers count cache hits as
# compilations, so what a test counts does not depend on which test ran first.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="spark_jax_xla_cache_")
    os.environ["SPARK_JAX_TEST_CACHE_OWNER"] = str(os.getpid())
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Compilation is most of the suite's CPU time, so the CPU's compiler is set for it:
# - LLVM's level-1 optimisation: the tiny models' programs are compiled far more than they
#   run, and level 1 compiles them ~30% faster than the default level 2 while the real
#   SmolLM2's longest passes run ~7% slower (level 0 halves their speed).
# - each program's LLVM module compiled whole, not split into parts for a thread pool: with
#   two cores busy with a test each, the split only adds work (tests/serving/test_engine.py
#   alone, two A/Bs: 8% and 27% less backend compile time).
# Both change LLVM's code generation only, not XLA's passes. (XLA reads its flags when jax
# starts its backend, after these imports.)
from benchmarks.common import add_xla_flag  # noqa: E402

add_xla_flag("--xla_backend_optimization_level=1")
add_xla_flag("--xla_cpu_parallel_codegen_split_count=1")

import jax  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import HF_BUILDERS, model_from_hf, smollm2_gguf_path  # noqa: E402

import spark_jax as sj  # noqa: E402

# The slowest files of the suite (seconds each on two CI cores), longest first. xdist's loadfile
# hands files to its two workers in collection order, so these start first and the short files
# even out the end instead of one long file running alone while the other core idles.
SLOWEST_FIRST = (
    "notebooks/03_lora_training.ipynb",
    "tests/serving/test_engine.py",
    "tests/models/test_quant_quality.py",
    "tests/generation/test_speculative.py",
    "tests/serving/test_engine_speculative.py",
    "tests/test_tensor_parallel.py",
    "tests/kernels/test_flash_attention_kernel.py",
    "tests/test_benchmarks.py",
    "tests/generation/test_beam.py",
    "tests/models/test_draft_head.py",
    "tests/serving/test_engine_nllb.py",
    "tests/generation/test_guided.py",
    "tests/models/test_lora_nllb.py",
    "tests/serving/test_server.py",
    "tests/models/test_lora.py",
    "notebooks/04_speculative_decoding.ipynb",
    "tests/conversion/test_gguf.py",
    "tests/models/test_forward_research.py",
    "tests/test_cli.py",
    "tests/kernels/test_one_query_kernel.py",
    "tests/generation/test_generate.py",
    "tests/ops/test_attention.py",
    "notebooks/01_quickstart.ipynb",
    "tests/kernels/test_paged_attention_kernel.py",
    "notebooks/06_translation.ipynb",
    "notebooks/02_inside_the_model.ipynb",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slowest files first (``SLOWEST_FIRST``), the rest in collection order after them;
    pyproject.toml turns off xdist's own reordering (by number of tests) so this order holds."""
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}

    def key(item: pytest.Item) -> int:
        return rank.get(item.path.relative_to(config.rootpath).as_posix(), len(rank))

    items.sort(key=key)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The process that made the run's compilation cache removes it."""
    if os.environ.get("SPARK_JAX_TEST_CACHE_OWNER") == str(os.getpid()):
        shutil.rmtree(Path(os.environ["JAX_COMPILATION_CACHE_DIR"]), ignore_errors=True)


@pytest.fixture(scope="session", params=sorted(HF_BUILDERS))
def hf_and_model(request):
    """(name, HF model, spark_jax Model) for every decoder family, same random weights."""
    torch.manual_seed(sorted(HF_BUILDERS).index(request.param))
    hf = HF_BUILDERS[request.param]().eval()
    return request.param, hf, model_from_hf(hf)


@pytest.fixture(scope="session")
def tiny_llama():
    torch.manual_seed(0)
    hf = HF_BUILDERS["llama3_untied"]().eval()
    return hf, model_from_hf(hf)


@pytest.fixture(scope="session")
def smollm2_converted(tmp_path_factory):
    """SmolLM2 converted once per session (fp32) by the project's converter."""
    from conversion.hf_to_orbax import convert

    dst = tmp_path_factory.mktemp("smollm2") / "converted"
    return convert(smollm2_gguf_path(), dst, "float32", progress=False)


@pytest.fixture(scope="session")
def smollm2(smollm2_converted) -> sj.Model:
    return sj.load(smollm2_converted)


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own load of the same GGUF (fp32): the oracle for the real model."""
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Frees each test module's compiled programs when it ends: the whole suite's unrolled
    models would otherwise stay compiled together and outgrow a CI machine's memory."""
    yield
    jax.clear_caches()
    gc.collect()
