"""Orbax save/restore of a converted model directory.

A converted directory ``DST`` holds everything needed to serve one model offline::

    DST/config.json              the HF config dict: verbatim, or with its quantization scheme
                                 as ``quantization_config`` when the weights are quantized
    DST/generation_config.json   when the source had one
    DST/tokenizer.json ...       tokenizer files under their HF names, whichever exist
    DST/params/                  orbax checkpoint of the params pytree (nested dict of arrays)

Only the params go through orbax; everything else is plain JSON or copied bytes so that the
directory stays readable without this package.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
PARAMS_DIR = "params"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "sentencepiece.bpe.model",
    "tokenizer.model",
    # transformers 5 saves the chat template beside tokenizer_config.json, not inside it.
    "chat_template.jinja",
)

Params = dict[str, Any]


def save_config(path: str | Path, config_bytes: bytes, quantization: Any = None) -> None:
    """Write ``DST/config.json``: the source's bytes, or, for a quantized model, its dict with
    ``quantization_config`` set to the scheme its params hold
    (``spark_jax.config.QuantizationConfig``, read back by ``config_from_hf``)."""
    target = Path(path) / CONFIG_FILE
    if quantization is None:
        target.write_bytes(config_bytes)
        return
    hf_config = json.loads(config_bytes)
    hf_config["quantization_config"] = quantization.to_hf()
    target.write_text(json.dumps(hf_config, indent=2))


def save_params(path: str | Path, params: Params) -> None:
    """Write a params pytree (nested dict of numpy or jax arrays) as an orbax checkpoint.

    ``path`` must not exist yet; orbax refuses to overwrite a finished checkpoint.
    """
    checkpointer = ocp.PyTreeCheckpointer()
    checkpointer.save(Path(path).absolute(), params)
    # PyTreeCheckpointer saves synchronously, but on some versions the commit marker is
    # finalised in a background thread; waiting makes the directory complete on return.
    wait = getattr(checkpointer, "wait_until_finished", None)
    if wait is not None:
        wait()


def _tree_metadata(checkpointer: ocp.PyTreeCheckpointer, path: Path) -> Any:
    """The per-leaf array metadata, whichever metadata wrapper this orbax version returns."""
    metadata = checkpointer.metadata(path)
    # orbax 0.12.x wraps the tree as StepMetadata(item_metadata=TreeMetadata(tree=...)); older
    # releases returned the tree itself. Unwrap whatever layers are present.
    metadata = getattr(metadata, "item_metadata", metadata)
    return getattr(metadata, "tree", metadata)


def restore_params(path: str | Path, dtype: Any = None, shardings: Any = None) -> Params:
    """Read a params checkpoint onto the default device, optionally cast to ``dtype``.

    ``shardings``: a tree of ``jax.sharding.Sharding`` in the params' shape (tensor
    parallelism: ``Declaration.load_shardings``); each device then reads only its own shard of
    each leaf from the checkpoint, so no device holds a whole sharded leaf at any point.

    Quantized kernels (one-byte fp8 / int8 leaves) keep their type whatever ``dtype`` is.

    Each leaf is read straight into a device array of the target dtype by orbax's
    tensorstore backend (cast during the read), so a 16 GB checkpoint needs no per-leaf
    Python copy or a second pass over host memory.
    """
    path = Path(path).absolute()
    checkpointer = ocp.PyTreeCheckpointer()
    # The sharding recorded at save time names the saving host's devices (or none, for
    # numpy leaves); restoring onto this process's default device is always valid.
    metadata = _tree_metadata(checkpointer, path)
    if shardings is None:
        single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: single, metadata)
    target = jax.tree.map(
        lambda leaf, sharding: jax.ShapeDtypeStruct(
            tuple(leaf.shape),
            np.dtype(leaf.dtype if dtype is None or _is_narrow(leaf.dtype) else dtype),
            sharding=sharding,
        ),
        metadata,
        shardings,
    )
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    return checkpointer.restore(
        path, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args)
    )


def _is_narrow(dtype: Any) -> bool:
    return np.dtype(dtype).itemsize == 1


def is_converted_dir(path: str | Path) -> bool:
    """True when ``path`` looks like a directory written by ``conversion.hf_to_orbax``."""
    path = Path(path)
    return (path / CONFIG_FILE).is_file() and (path / PARAMS_DIR).is_dir()


def read_config(path: str | Path) -> dict[str, Any]:
    """The HF config dict stored in a converted directory."""
    return json.loads((Path(path) / CONFIG_FILE).read_text())
