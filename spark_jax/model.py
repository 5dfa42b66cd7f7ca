"""The loaded-model handle.

``load(path)`` turns a converted checkpoint directory into a ``Model``: config, params,
tokenizer and the family's runner. Generation (``spark_jax.generation``) imports no model
file: it only calls the runner protocols of ``spark_jax.protocol``, which both families
implement.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from spark_jax.config import ModelConfig, NllbConfig, config_from_hf
from spark_jax.models import declare, family
from spark_jax.models.common import ForwardOutput, bucket
from spark_jax.ops.options import KernelOptions
from spark_jax.ops.sampling import SamplingParams


class SlotPool:
    """Bounded sequence slots; every acquired slot is given back, on error too."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots))[::-1]
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int:
        return self.num_slots - len(self._free)

    def acquire(self, n: int) -> list[int]:
        with self._lock:
            if n > len(self._free):
                raise RuntimeError(
                    f"{n} sequences asked for but only {len(self._free)} of {self.num_slots} "
                    "slots are free; wait for running requests to finish or raise max_num_seqs."
                )
            return [self._free.pop() for _ in range(n)]

    def release(self, slots: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(slots)


@dataclass
class Model:
    """A model ready to generate: its config, parameters, tokenizer and step runner."""

    config: ModelConfig | NllbConfig
    params: Any
    tokenizer: Any = None
    generation_config: dict[str, Any] = field(default_factory=dict)
    runner: Any = None
    max_num_seqs: int = 256  # sequences generated at once, over all concurrent calls
    # The kernels its steps run (static in every jitted step: a model with other options
    # compiles its own programs beside this one's).
    options: KernelOptions = field(default_factory=KernelOptions)
    # The K/V cache of every generation path: "auto" (the model dtype) or "fp8" (E4M3 with
    # per-kv-head scales, dequantized in attention; decoder-only models). vLLM's name.
    kv_cache_dtype: str = "auto"
    # Tensor parallelism: the one-axis ("tp") mesh the params and caches are sharded over
    # (``load(path, tensor_parallel=N)``); None: one device.
    mesh: Mesh | None = None

    def __post_init__(self) -> None:
        if self.mesh is not None and self.options.mesh is None:  # attention per shard
            self.options = dataclasses.replace(self.options, mesh=self.mesh)
        self.slot_pool = SlotPool(self.max_num_seqs)
        self._lora_lock = threading.Lock()  # one adapter change at a time (each builds on the last)
        if self.runner is None:
            runner = family(self.config).Runner
            self.runner = runner(self.config, self.params, self.tokenizer, options=self.options)
        self.runner.eos_token_ids = self.eos_token_ids
        self.runner.mesh = self.mesh
        from spark_jax.ops.kv_cache import check_kv_cache_dtype

        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.kv_cache_dtype != "auto":
            if self.config.is_encoder_decoder:
                raise ValueError(
                    f"kv_cache_dtype={self.kv_cache_dtype!r} is for decoder-only models; "
                    "leave it 'auto' for an encoder-decoder."
                )
            self.runner.kv_cache_dtype = self.kv_cache_dtype

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Token ids that end generation: the config's, generation_config's and tokenizer's."""
        ids = list(self.config.eos_token_ids)
        gen = self.generation_config.get("eos_token_id")
        ids += [gen] if isinstance(gen, int) else list(gen or [])
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None:
            ids.append(tok_eos)
        return tuple(dict.fromkeys(int(i) for i in ids))

    @property
    def dtype(self) -> jnp.dtype:
        """The activations' dtype (the runner's; a quantized kernel's narrow type is not it)."""
        runner_dtype = getattr(self.runner, "dtype", None)
        if runner_dtype is not None:
            return runner_dtype
        return jax.tree_util.tree_leaves(self.params)[0].dtype

    def logits(
        self,
        ids: Sequence[int],
        decoder_ids: Sequence[int] | None = None,
        adapter: str | None = None,
    ) -> np.ndarray:
        """float32 [T, V] logits of every position (of ``decoder_ids`` for encoder-decoders)."""
        kwargs = {} if adapter is None else {"adapter": self.adapter_slot(adapter)}
        if self.config.is_encoder_decoder:
            if decoder_ids is None:
                raise ValueError("an encoder-decoder model needs decoder_ids for logits.")
            return self.runner.logits(ids, decoder_ids, **kwargs)
        return self.runner.logits(ids, **kwargs)

    # Research: the teacher-forced forward with HF's intermediates, the cache of a prompt and
    # the log-probabilities of a continuation. These run the reference path (``forward_outputs``
    # of the family), never the serving steps.

    def forward(
        self,
        ids: Sequence[int],
        decoder_ids: Sequence[int] | None = None,
        output_hidden_states: bool = False,
        output_attentions: bool = False,
        adapter: str | None = None,
    ) -> ForwardOutput:
        """One sequence through the model, as HF's ``model(ids, output_hidden_states=...,
        output_attentions=...)`` without the batch axis, as float32 numpy arrays.

        ``.logits`` [T, V]; ``.hidden_states``: L + 1 arrays [T, D] (the embeddings, each
        layer's output, the last after the final norm); ``.attentions``: L arrays [N, T, T] of
        probabilities. An encoder-decoder reads ``ids`` as the source and describes its decoder
        over ``decoder_ids`` (start token, target language, tokens), adding ``.cross_attentions``
        (L arrays [N, T, S_src]).
        """
        ids = list(ids)
        if not ids:
            raise ValueError("ids is empty; give at least one token.")
        lora = None if adapter is None else self.runner.lora_input([self.adapter_slot(adapter)])
        options = dataclasses.replace(self.options, implementation="xla", pallas_layer_norm=False)
        flags = {
            "output_hidden_states": output_hidden_states,
            "output_attentions": output_attentions,
            "options": options,
        }
        forward_outputs = family(self.config).forward_outputs
        if self.config.is_encoder_decoder:
            if not decoder_ids:
                raise ValueError(
                    "an encoder-decoder model needs decoder_ids for forward (start with "
                    "[decoder_start_token_id, target language id])."
                )
            self.runner.check_source(ids)
            t, s = len(decoder_ids), len(ids)
            pad = self.config.pad_token_id
            src, dec = _padded(ids, pad), _padded(decoder_ids, pad)
            out = forward_outputs(
                self.runner.params, self.config, src, np.array([s], np.int32), dec, lora, **flags
            )
        else:
            if decoder_ids is not None:
                raise ValueError("a decoder-only model takes no decoder_ids; pass ids alone.")
            t = s = len(ids)
            tokens = _padded(ids, 0)
            out = forward_outputs(
                self.runner.params, self.config, tokens, np.array([t], np.int32), lora, **flags
            )
        keep = lambda arrays, cut: None if arrays is None else tuple(cut(a) for a in arrays)
        return ForwardOutput(
            logits=np.asarray(out.logits[0, :t], np.float32),
            hidden_states=keep(out.hidden_states, lambda h: np.asarray(h[0, :t], np.float32)),
            attentions=keep(out.attentions, lambda a: np.asarray(a[0, :, :t, :t])),
            cross_attentions=keep(out.cross_attentions, lambda a: np.asarray(a[0, :, :t, :s])),
        )

    def continuation_logprobs(
        self,
        ids: Sequence[int],
        continuation: Sequence[int],
        tgt_lang: str | None = None,
        adapter: str | None = None,
    ) -> np.ndarray:
        """float32 [len(continuation)]: log p(continuation[i] | ids, continuation[:i]),
        teacher-forced in one forward. An encoder-decoder reads ``ids`` as the source and the
        continuation as the target after ``[decoder_start, tgt_lang]`` (the default target
        language when None)."""
        continuation = list(continuation)
        if not continuation:
            raise ValueError("continuation is empty; give at least one token to score.")
        if self.config.is_encoder_decoder:
            request = SamplingParams(tgt_lang=tgt_lang)
            seed = [self.config.decoder_start_token_id, self.runner.target_language_id(request)]
            logits = self.forward(ids, seed + continuation[:-1], adapter=adapter).logits
            rows = logits[len(seed) - 1 :]
        else:
            if tgt_lang is not None:
                raise ValueError("tgt_lang is for an encoder-decoder; this model is decoder-only.")
            logits = self.forward(list(ids) + continuation[:-1], adapter=adapter).logits
            rows = logits[len(ids) - 1 :]
        logprobs = rows - _logsumexp(rows)
        return logprobs[np.arange(len(continuation)), continuation]

    def kv_cache(
        self, ids: Sequence[int], tgt_lang: str | None = None, max_len: int | None = None
    ) -> Any:
        """The cache pytree the serving prefill leaves for one prompt (one row): a ``KVCache``
        for a decoder, an ``EncoderDecoderCache`` (self and cross K/V) for an encoder-decoder,
        where ``ids`` is the source and the decoder holds its seed. ``max_len``: positions per
        row (default: the prompt's padded length, or the seed's)."""
        ids = list(ids)
        if self.config.is_encoder_decoder:
            state = self.runner.init_state(1, max_len or bucket(2), len(ids))
            requests = [SamplingParams(tgt_lang=tgt_lang)]
        else:
            if tgt_lang is not None:
                raise ValueError("tgt_lang is for an encoder-decoder; this model is decoder-only.")
            state = self.runner.init_state(1, max_len or bucket(len(ids)))
            requests = []
        _, state = self.runner.prefill(state, [0], [ids], requests)
        return state

    # LoRA adapters: a fixed pool, so adding one never recompiles a step. Every change builds
    # new params (``_adapt``); steps only read them, and a tree taken from ``params`` earlier
    # stays intact and valid.

    @property
    def lora_pool(self) -> Any:
        return self.runner.lora_pool

    def enable_lora(self, max_adapters: int = 8, max_rank: int = 16) -> None:
        """Creates the adapter pool (its size is fixed: steps compile once for it).

        A decoder's params become a new tree with its adapted kernels widened to [W | A] (A
        zero until an adapter is added); warm an engine up after this, not before.
        """
        from spark_jax.ops.lora import LoraPool

        with self._lora_lock:
            if self.lora_pool is not None:
                raise ValueError("LoRA is already enabled; remove adapters instead of resizing.")
            # Adapters name the checkpoint's layers; a tensor-parallel layout's shard-major
            # columns (and KV head copies) are where their updates then go.
            plain = self.config.plain()
            targets = family(plain).lora_targets(plain)
            layouts = declare(plain).lora_layouts(self.tensor_parallel)
            self.runner.lora_pool = LoraPool(
                targets, max_adapters, max_rank, self.dtype, layouts, self.mesh
            )
            self._adapt()

    def add_adapter(self, name: str, path: str | Path) -> None:
        """Loads a PEFT adapter directory under ``name`` (selected by SamplingParams.adapter).

        ``self.params`` is then a new tree holding the adapter (a decoder stores the pool's A
        beside its kernels, see ``LoraPool.fused_params``); the previous tree is left intact.
        ``merged`` gives plain params with one adapter folded in.
        """
        from spark_jax.ops.lora import read_peft_adapter

        adapter = read_peft_adapter(path, name)
        if self.lora_pool is None:
            self.enable_lora(max_rank=max(16, adapter.rank))
        with self._lora_lock:
            self.lora_pool.add(adapter)
            self._adapt()

    def remove_adapter(self, name: str) -> None:
        """Unloads an adapter; ``self.params`` is then a new tree without it (see add_adapter)."""
        if self.lora_pool is None:
            raise ValueError(f"adapter {name!r} is not loaded; no adapter is.")
        with self._lora_lock:
            self.lora_pool.remove(name)
            self._adapt()

    def _adapt(self) -> None:
        """Sets the params every later step reads: the runner's form of ``self.params`` for its
        pool (``Runner.lora_params``: new arrays for the adapted kernels, every other leaf
        shared). Nothing of the previous tree is changed or deleted."""
        params = self.runner.lora_params(self.params)
        self.params = params
        self.runner.params = params

    def adapter_slot(self, name: str | None) -> int:
        """The pool slot of an adapter name (-1 = base); unknown names are refused."""
        from spark_jax.ops.lora import adapter_slot

        return adapter_slot(self.lora_pool, name)

    def merged(self, name: str) -> Model:
        """A copy of this model with one adapter folded into its weights (no per-row LoRA).

        Its adapted kernels are new, plain ``[in, out]`` arrays (fit to save) even when this
        model's are fused; the other weights are shared (and this model is unchanged).
        """
        self.adapter_slot(name)  # unknown names (or no pool) are refused clearly
        params = self.lora_pool.merged_params(self.params, name)
        return Model(
            self.config,
            params,
            self.tokenizer,
            self.generation_config,
            options=self.options,
            kv_cache_dtype=self.kv_cache_dtype,
            mesh=self.mesh,
        )

    @property
    def tensor_parallel(self) -> int:
        """Devices the model is sharded over."""
        return 1 if self.mesh is None else self.mesh.devices.size


def load(
    path: str | Path,
    dtype: str | jnp.dtype | None = None,
    options: KernelOptions | None = None,
    kv_cache_dtype: str = "auto",
    tensor_parallel: int = 1,
) -> Model:
    """Loads a directory written by ``python -m conversion.hf_to_orbax``; its steps run the
    kernels ``options`` choose (default ``KernelOptions()``: the dispatch picks), over a K/V
    cache of ``kv_cache_dtype`` ("auto" or "fp8").

    ``tensor_parallel=N`` shards the model over the first N devices (``jax.devices()``: every
    process's under ``jax.distributed``), one ``"tp"`` mesh axis: attention by heads, the MLP
    by FFN columns then rows, the embedding and LM head by vocab, K/V by KV heads (copied
    where fewer than N), each shard read from the checkpoint straight onto its device
    (``load_sharded``). XLA inserts the all-reduces; attention runs per shard under
    ``shard_map`` through the usual dispatch (``KernelOptions.mesh``).
    """
    from spark_jax.checkpoint import PARAMS_DIR, restore_params
    from spark_jax.tokenizer import Tokenizer

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(
            f"{path} has no config.json; convert the model first with "
            "`python -m conversion.hf_to_orbax SRC DST` and load DST."
        )
    hf_config = json.loads(config_file.read_text())
    config = config_from_hf(hf_config)
    options = KernelOptions() if options is None else options
    mesh = None
    if tensor_parallel == 1:
        params = restore_params(path / PARAMS_DIR, dtype=dtype)
    else:
        config, params, mesh = load_sharded(path / PARAMS_DIR, config, tensor_parallel, dtype)
    _check_quantized(path, config, params)
    gen_file = path / "generation_config.json"
    generation_config = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    tokenizer = Tokenizer.from_dir(path) if _has_tokenizer(path) else None
    return Model(
        config,
        params,
        tokenizer,
        generation_config,
        options=options,
        kv_cache_dtype=kv_cache_dtype,
        mesh=mesh,
    )


def load_sharded(
    params_dir: str | Path, config: ModelConfig | NllbConfig, tensor_parallel: int, dtype: Any
) -> tuple[ModelConfig | NllbConfig, Any, Mesh]:
    """The params checkpoint at ``params_dir`` sharded over ``tensor_parallel`` devices:
    (the config laid out for them, the params, the mesh).

    Orbax reads every shard straight onto its device (``restore_params`` with the target
    shardings): no device ever holds a whole sharded weight. A fused kernel (Q/K/V, gate/up)
    is read split by rows, its columns put in shard-major order where each row block lies,
    then moved to its column shards (``Declaration.shard_major``).
    """
    from spark_jax.checkpoint import restore_params
    from spark_jax.models import declare
    from spark_jax.ops.sharding import make_mesh

    sharded_config = config.for_tensor_parallel(tensor_parallel)
    mesh = make_mesh(tensor_parallel)
    plain, laid_out = declare(config), declare(sharded_config)
    params = restore_params(params_dir, dtype=dtype, shardings=plain.load_shardings(mesh))
    params = plain.shard_major(params, tensor_parallel, laid_out.shardings(mesh))
    return sharded_config, params, mesh


def shard_params(
    config: ModelConfig | NllbConfig, params: Any, tensor_parallel: int
) -> tuple[ModelConfig | NllbConfig, Any, Mesh]:
    """An in-memory params tree (random init, benchmarks) sharded as ``load_sharded`` shards
    a checkpoint: (the config laid out for ``tensor_parallel`` devices, the params, the mesh).
    Build the model with ``Model(config, params, mesh=mesh)``."""
    from spark_jax.models import declare
    from spark_jax.ops.sharding import make_mesh

    sharded_config = config.for_tensor_parallel(tensor_parallel)
    mesh = make_mesh(tensor_parallel)
    plain, laid_out = declare(config), declare(sharded_config)
    params = jax.device_put(params, plain.load_shardings(mesh))
    params = plain.shard_major(params, tensor_parallel, laid_out.shardings(mesh))
    return sharded_config, params, mesh


def _check_quantized(path: Path, config: Any, params: Any) -> None:
    """A quantized config's narrow kernels each need their scales in the checkpoint."""
    if getattr(config, "quantization", None) is None:
        return
    from spark_jax.models.params import SCALE

    missing = []
    for p in family(config).declare(config).quantized:
        node = params
        for key in p.path[:-1]:
            node = node.get(key, {})
        if SCALE not in node:
            missing.append("/".join(p.scale_path))
    if missing:
        raise ValueError(
            f"{path}: config.json says the weights are {config.quantization.weights} but "
            f"{len(missing)} kernel scales are missing from its params (first: {missing[0]}); "
            "convert the model again."
        )


def _padded(ids: Sequence[int], pad: int) -> np.ndarray:
    """int32 [1, bucket(len(ids))]: one row padded on the right (one compile per bucket)."""
    row = np.full((1, bucket(len(ids))), pad, np.int32)
    row[0, : len(ids)] = ids
    return row


def _logsumexp(x: np.ndarray) -> np.ndarray:
    peak = x.max(axis=-1, keepdims=True)
    return peak + np.log(np.exp(x - peak).sum(axis=-1, keepdims=True))


def _has_tokenizer(path: Path) -> bool:
    names = ("tokenizer.json", "tokenizer.model", "sentencepiece.bpe.model")
    return any((path / n).is_file() for n in names)
