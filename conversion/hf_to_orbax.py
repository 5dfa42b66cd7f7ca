"""Convert an HF model directory or a GGUF file into a spark_jax checkpoint directory.

    python -m conversion.hf_to_orbax SRC DST [--dtype bfloat16|float32]
        [--quantize fp8|int8|none] [--group-size G] [--quantize-lm-head]

SRC is an HF directory (``config.json`` with ``model.safetensors``, or shards listed in
``model.safetensors.index.json``) or a llama.cpp ``.gguf`` file. DST receives the layout
described in ``spark_jax.checkpoint``: config.json, generation_config.json, tokenizer files
and the orbax params checkpoint.

``--quantize`` stores the linear layers' kernels narrow (weight-only, fp8 E4M3 or int8) with
float32 scales per output channel, or per group of G input channels with ``--group-size``;
embeddings, norms and (unless ``--quantize-lm-head``) the LM head keep ``--dtype``. The scheme
goes into DST/config.json's ``quantization_config``. A source already quantized (fp8 weights in
the compressed-tensors layout: ``weight`` + ``weight_scale``, as vLLM reads them) keeps its
weights and scales as they are; it is never dequantized or quantized again.

Every tensor name and shape is checked against the model's weight spec before any weight is
read, and each failure is one ``ConversionError`` saying what is wrong and what to do. Pickle
weights (``.bin``, ``.pt``, ``.pth``) are refused and never unpickled: loading them can run
arbitrary code.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from spark_jax import checkpoint
from spark_jax.config import WEIGHT_QUANTIZATIONS, QuantizationConfig, config_from_hf
from spark_jax.models import declare

DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"

# safetensors dtype names -> numpy dtypes. bfloat16 and float8 come from ml_dtypes: numpy
# cannot name them, which is why safetensors' own numpy reader refuses bf16 checkpoints.
_SAFETENSORS_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


class ConversionError(ValueError):
    """The source cannot be converted; the message says what is wrong and what to do."""


class SourceTensors(Mapping[str, np.ndarray]):
    """A checkpoint's tensors by HF name: shapes known up front, data read on access."""

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: self.shape(name) for name in self}


@dataclass
class Source:
    """What a model source provides, whatever its format."""

    hf_config: dict[str, Any]
    config_bytes: bytes  # written to DST/config.json unchanged
    tensors: SourceTensors
    # file name -> contents (GGUF, rebuilt) or path to copy (HF directory)
    extra_files: dict[str, str | bytes | Path] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Safetensors sources.


class SafetensorsTensors(SourceTensors):
    """Tensors of one or more safetensors files, each memory-mapped when read.

    The files are validated by ``safe_open`` when this is built; reads then map the raw
    little-endian bytes directly, the one path that serves every dtype including bfloat16.
    """

    def __init__(self, files: list[Path]) -> None:
        self._file_of: dict[str, Path] = {}
        self._info: dict[str, tuple[np.dtype, tuple[int, ...], int]] = {}  # dtype, shape, offset
        for path in files:
            for name, info in _safetensors_header(path).items():
                if name in self._file_of:
                    raise ConversionError(
                        f"tensor {name} appears in both {self._file_of[name].name} and "
                        f"{path.name}; remove the stale shard or re-save the model."
                    )
                self._file_of[name] = path
                self._info[name] = info

    def __getitem__(self, name: str) -> np.ndarray:
        dtype, shape, offset = self._info[name]
        if 0 in shape or not shape:
            # np.memmap cannot map zero bytes or a 0-d array; such tensors are tiny anyway.
            with safe_open(self._file_of[name], framework="numpy") as f:
                return np.asarray(f.get_slice(name)[...], dtype=dtype).reshape(shape)
        return np.memmap(self._file_of[name], dtype=dtype, mode="r", offset=offset, shape=shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info[name][1]


def _safetensors_header(path: Path) -> dict[str, tuple[np.dtype, tuple[int, ...], int]]:
    """name -> (dtype, shape, absolute byte offset of the data), after safetensors validates."""
    try:
        # safe_open checks that the header parses and that the data it describes fits the
        # file, which catches truncated downloads before any tensor is read.
        with safe_open(path, framework="numpy") as f:
            names = list(f.keys())
    except (SafetensorError, OSError) as error:
        raise ConversionError(
            f"{path} is not a readable safetensors file ({error}); it is probably truncated or "
            "corrupt. Download or save it again."
        ) from error
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    data_start = 8 + header_len
    unknown = sorted({header[n]["dtype"] for n in names} - set(_SAFETENSORS_DTYPES))
    if unknown:
        raise ConversionError(
            f"{path} stores tensors as {', '.join(unknown)}, which this converter cannot read; "
            "re-save the model in float32, float16 or bfloat16."
        )
    return {
        name: (
            _SAFETENSORS_DTYPES[header[name]["dtype"]],
            tuple(header[name]["shape"]),
            data_start + header[name]["data_offsets"][0],
        )
        for name in names
    }


def _open_hf_dir(src: Path) -> Source:
    config_path = src / checkpoint.CONFIG_FILE
    weight_files = _safetensors_files(src)
    if not config_path.is_file():
        raise ConversionError(
            f"{src} has weights but no config.json; copy the model's config.json next to them."
        )
    config_bytes = config_path.read_bytes()
    try:
        hf_config = json.loads(config_bytes)
    except json.JSONDecodeError as error:
        raise ConversionError(f"{config_path} is not valid JSON ({error}); fix it.") from error
    extra: dict[str, str | bytes | Path] = {
        name: src / name
        for name in (checkpoint.GENERATION_CONFIG_FILE, *checkpoint.TOKENIZER_FILES)
        if (src / name).is_file()
    }
    return Source(hf_config, config_bytes, SafetensorsTensors(weight_files), extra)


def _safetensors_files(src: Path) -> list[Path]:
    """The weight files of an HF directory, refusing pickles and naming what is missing."""
    index_path = src / SAFETENSORS_INDEX
    if index_path.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ConversionError(
                f"{index_path} is not a valid safetensors index (no weight_map: {error}); "
                "save the model again."
            ) from error
        shards = sorted({src / name for name in weight_map.values()})
        absent = [p.name for p in shards if not p.is_file()]
        if absent:
            raise ConversionError(
                f"{index_path.name} lists shards that are not in {src}: {', '.join(absent)}; "
                "download the missing shards."
            )
        return shards
    if (src / SAFETENSORS_FILE).is_file():
        return [src / SAFETENSORS_FILE]

    pickles = sorted(p.name for p in src.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ConversionError(
            f"{src} holds only PyTorch pickle weights ({', '.join(pickles)}); they are refused "
            "because unpickling can run arbitrary code. Re-save the model as safetensors "
            "(model.save_pretrained(dir, safe_serialization=True)) and convert that."
        )
    ggufs = sorted(p.name for p in src.glob("*.gguf"))
    if ggufs:
        raise ConversionError(
            f"{src} has no safetensors weights but holds {', '.join(ggufs)}; pass the .gguf "
            "file itself as SRC."
        )
    raise ConversionError(
        f"{src} has no model weights: expected {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} with "
        "its shards. Point SRC at an HF model directory or a .gguf file."
    )


# ---------------------------------------------------------------------------------------------
# GGUF sources.


class _GGUFSourceTensors(SourceTensors):
    def __init__(self, tensors: Any) -> None:
        self._tensors = tensors

    def __getitem__(self, name: str) -> np.ndarray:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._tensors.shape(name)


def _open_gguf(src: Path) -> Source:
    # gguf (and its numpy memmap reader) is only needed for GGUF sources.
    from conversion.gguf_reader import read_gguf

    try:
        gguf_checkpoint = read_gguf(src)
    except ConversionError:
        raise
    except (ValueError, OSError, KeyError) as error:
        raise ConversionError(f"cannot read GGUF file {src}: {error}") from error
    extra: dict[str, str | bytes | Path] = dict(gguf_checkpoint.tokenizer_files)
    if gguf_checkpoint.generation_config:
        extra[checkpoint.GENERATION_CONFIG_FILE] = json.dumps(
            gguf_checkpoint.generation_config, indent=2
        )
    config_bytes = json.dumps(gguf_checkpoint.config, indent=2).encode()
    return Source(
        gguf_checkpoint.config, config_bytes, _GGUFSourceTensors(gguf_checkpoint.tensors), extra
    )


# ---------------------------------------------------------------------------------------------
# Conversion.


def open_source(src: str | Path) -> Source:
    """Open an HF directory or a GGUF file, validating its files but reading no weights."""
    src = Path(src)
    if not src.exists():
        raise ConversionError(f"{src} does not exist; pass an HF model directory or a .gguf file.")
    if src.is_dir():
        return _open_hf_dir(src)
    if src.suffix == ".gguf":
        return _open_gguf(src)
    if src.suffix in PICKLE_SUFFIXES:
        raise ConversionError(
            f"{src} is a PyTorch pickle file; it is refused because unpickling can run "
            "arbitrary code. Re-save the model as safetensors and convert that directory."
        )
    raise ConversionError(
        f"{src} is neither a directory nor a .gguf file; pass an HF model directory (with "
        "config.json and safetensors weights) or a .gguf file."
    )


class _CountingTensors(Mapping[str, np.ndarray]):
    """Advances a progress bar on each tensor read."""

    def __init__(self, tensors: Mapping[str, np.ndarray], progress: tqdm) -> None:
        self._tensors = tensors
        self._progress = progress

    def __getitem__(self, name: str) -> np.ndarray:
        value = self._tensors[name]
        self._progress.update(1)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


QUANTIZE_CHOICES = (*WEIGHT_QUANTIZATIONS, "none")


def convert(
    src: str | Path,
    dst: str | Path,
    dtype: str = "bfloat16",
    progress: bool = True,
    quantize: str | None = None,
    group_size: int | None = None,
    quantize_lm_head: bool = False,
) -> Path:
    """Convert SRC (HF directory or .gguf) into the checkpoint directory DST; returns DST.

    ``quantize``: "fp8" or "int8" (weight-only, see the module docstring), "none", or None for
    the source's own scheme (none for a float source). DST must not exist or be empty. It is
    written under a temporary name and renamed at the end, so a failed conversion never leaves
    a directory that looks converted.
    """
    dst = Path(dst)
    if dtype not in DTYPES:
        raise ConversionError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}.")
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise ConversionError(
            f"--quantize {quantize!r} is not supported; use one of {', '.join(QUANTIZE_CHOICES)}."
        )
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ConversionError(f"{dst} already exists and is not empty; remove it or pick another.")

    source = open_source(src)
    try:
        config = config_from_hf(source.hf_config)
    except (ValueError, KeyError, TypeError) as error:
        raise ConversionError(f"{src}: config.json cannot be used: {error}") from error
    config, prequantized = _quantization(config, src, quantize, group_size, quantize_lm_head)
    declaration = declare(config)
    spec = declaration.weight_spec(prequantized)
    found = source.tensors.shapes()
    missing_scales = sorted(n for n in spec.required if n.endswith("_scale") and n not in found)
    if missing_scales:
        raise ConversionError(
            f"{src}: config.json says the weights are quantized (fp8, compressed-tensors) but "
            f"{len(missing_scales)} weight_scale tensors are missing (first: "
            f"{missing_scales[0]}); the checkpoint is incomplete, download or save it again."
        )
    problems = spec.check(found)
    if problems:
        raise ConversionError(
            f"{src}: the weights do not match the {source.hf_config.get('model_type')} model "
            "its config.json describes; check that config and weights belong together:\n  - "
            + "\n  - ".join(problems)
        )

    used = len(spec.required) + sum(name in source.tensors for name in spec.optional)
    with tqdm(total=used, desc="reading weights", unit="tensor", disable=not progress) as bar:
        params = declaration.from_hf(_CountingTensors(source.tensors, bar))
    # The cast also makes each leaf contiguous (from_hf returns transposed views) and detaches
    # it from memory-mapped source files; quantized kernels and their scales keep their types.
    params = declaration.cast(params, DTYPES[dtype])

    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        quantization = getattr(config, "quantization", None)
        checkpoint.save_config(staging, source.config_bytes, quantization)
        for name, content in source.extra_files.items():
            if isinstance(content, Path):
                shutil.copyfile(content, staging / name)
            else:
                data = content.encode() if isinstance(content, str) else content
                (staging / name).write_bytes(data)
        checkpoint.save_params(staging / checkpoint.PARAMS_DIR, params)
        if dst.exists():
            dst.rmdir()
        staging.rename(dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dst


def _quantization(
    config: Any, src: Any, quantize: str | None, group_size: int | None, lm_head: bool
) -> tuple[Any, bool]:
    """The config with the scheme the converted params will hold, and whether the source
    already holds it (a compressed-tensors checkpoint: weights and scales read as they are)."""
    held = getattr(config, "quantization", None)
    if held is not None:
        if quantize == "none":
            raise ConversionError(
                f"{src} holds {held.weights} weights (compressed-tensors) and --quantize none "
                "would save them unquantized, which is refused; omit --quantize to keep them."
            )
        if quantize not in (None, held.weights) or group_size is not None or lm_head:
            raise ConversionError(
                f"{src} already holds {held.weights} weights with per-channel scales; they are "
                "never quantized again: omit --quantize, --group-size and --quantize-lm-head."
            )
        return config, True
    if quantize in (None, "none"):
        if group_size is not None or lm_head:
            raise ConversionError(
                "--group-size and --quantize-lm-head need --quantize fp8 or int8; add it."
            )
        return config, False
    if config.is_encoder_decoder:
        raise ConversionError(
            f"--quantize is for decoder-only models; {config.model_type} converts unquantized."
        )
    try:
        scheme = QuantizationConfig(quantize, group_size, lm_head)
    except ValueError as error:
        raise ConversionError(str(error)) from error
    config = dataclasses.replace(config, quantization=scheme)
    if group_size is not None:
        in_dims = {config.hidden_size, config.q_size, config.intermediate_size}
        if any(d % group_size for d in in_dims):
            raise ConversionError(
                f"--group-size {group_size} does not divide every quantized layer's input "
                f"size ({', '.join(map(str, sorted(in_dims)))}); pick a common divisor."
            )
    return config, False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m conversion.hf_to_orbax",
        description="Convert an HF model directory or a .gguf file to a spark_jax checkpoint.",
    )
    parser.add_argument("src", help="HF model directory or .gguf file")
    parser.add_argument("dst", help="output directory (must not exist, or be empty)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    # Checked by convert (not argparse's choices) so a bad value is one line of ours.
    parser.add_argument(
        "--quantize",
        default=None,
        help="weight-only quantization: fp8, int8 or none (default: the source's own)",
    )
    parser.add_argument(
        "--group-size", type=int, default=None, help="input channels per scale (default: all)"
    )
    parser.add_argument("--quantize-lm-head", action="store_true", help="quantize the LM head")
    args = parser.parse_args(argv)
    try:
        dst = convert(
            args.src,
            args.dst,
            args.dtype,
            quantize=args.quantize,
            group_size=args.group_size,
            quantize_lm_head=args.quantize_lm_head,
        )
    except ConversionError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
