"""Model configurations, parsed once from a HuggingFace ``config.json`` dict.

Configs are frozen dataclasses: hashable, so a config is a valid static argument of a jitted
step and equal configs share one compilation. Both the old (``rope_theta``, ``rope_scaling``,
``torch_dtype``) and the transformers-5 (``rope_parameters``, ``dtype``) spellings are accepted.

A quantized checkpoint says so in ``quantization_config`` (HF's key): either ours (written by
``conversion.hf_to_orbax --quantize``) or compressed-tensors' fp8 layout, as vLLM reads it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

DECODER_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ENCODER_DECODER_MODEL_TYPES = ("m2m_100",)
SUPPORTED_MODEL_TYPES = DECODER_MODEL_TYPES + ENCODER_DECODER_MODEL_TYPES
WEIGHT_QUANTIZATIONS = ("fp8", "int8")
QUANT_METHOD = "spark_jax"  # quantization_config["quant_method"] of our own checkpoints


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters: the base and an optional frequency rescaling."""

    theta: float = 10000.0
    kind: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inverse_frequencies(self, head_dim: int) -> list[float]:
        """Per-pair inverse frequencies, rescaled as the HF rope type of this name does."""
        base = [1.0 / (self.theta ** (i / head_dim)) for i in range(0, head_dim, 2)]
        if self.kind == "default":
            return base
        if self.kind == "linear":
            return [f / self.factor for f in base]
        # llama3: long wavelengths are divided by `factor`, short ones kept, the middle band
        # interpolated smoothly between the two.
        old_len = self.original_max_position_embeddings
        low_wavelen = old_len / self.low_freq_factor
        high_wavelen = old_len / self.high_freq_factor
        out = []
        for f in base:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / self.factor)
            else:
                smooth = (old_len / wavelen - self.low_freq_factor) / (
                    self.high_freq_factor - self.low_freq_factor
                )
                out.append((1 - smooth) * f / self.factor + smooth * f)
        return out


@dataclass(frozen=True)
class QuantizationConfig:
    """Weight-only quantization of the linear layers: narrow weights, float scales.

    ``weights``: "fp8" (E4M3, |w| <= 448 after scaling) or "int8" (symmetric, |q| <= 127).
    ``group_size``: input channels sharing one scale per output channel; None is one scale per
    output channel (over all its inputs). ``lm_head``: quantize an untied LM head too.
    Activations, norms, embeddings and the K/V cache keep the model dtype.
    """

    weights: str
    group_size: int | None = None
    lm_head: bool = False

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_QUANTIZATIONS:
            raise ValueError(
                f"weight quantization {self.weights!r} is not supported; use one of "
                f"{', '.join(WEIGHT_QUANTIZATIONS)}."
            )
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"group_size must be a positive integer, got {self.group_size}.")

    def to_hf(self) -> dict[str, Any]:
        """The ``quantization_config`` entry of a converted checkpoint's config.json."""
        return {
            "quant_method": QUANT_METHOD,
            "weights": self.weights,
            "group_size": self.group_size,
            "lm_head": self.lm_head,
        }


def quantization_from_hf(hf: dict[str, Any]) -> QuantizationConfig | None:
    """The scheme in a config dict's ``quantization_config`` (None when it has none).

    Ours, or compressed-tensors with 8-bit float weights per channel or per tensor (its
    ``weight_scale`` tensors are read as per-channel scales); anything else is refused.
    Compressed-tensors' activation quantization (W8A8) is not applied: activations stay in
    the model dtype, so the weights' numerics are the checkpoint's.
    """
    q = hf.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == QUANT_METHOD:
        return QuantizationConfig(q["weights"], q.get("group_size"), bool(q.get("lm_head")))
    if method == "compressed-tensors":
        groups = list((q.get("config_groups") or {}).values())
        weights = [g.get("weights") or {} for g in groups]
        fp8 = all(
            w.get("num_bits") == 8
            and w.get("type") == "float"
            and w.get("strategy") in ("channel", "tensor")
            and w.get("symmetric", True)
            for w in weights
        )
        if not weights or not fp8 or q.get("format") not in (None, "float-quantized"):
            raise ValueError(
                "this compressed-tensors checkpoint is not fp8 weights per channel or per "
                "tensor (float-quantized); only that compressed-tensors scheme is supported."
            )
        ignored = q.get("ignore") or []
        return QuantizationConfig("fp8", None, lm_head="lm_head" not in ignored)
    raise ValueError(
        f"quantization_config quant_method {method!r} is not supported; supported are "
        f"{QUANT_METHOD!r} and 'compressed-tensors' (fp8)."
    )


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer (llama, mistral, qwen2, qwen3 and their relatives)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # qwen2
    qk_norm: bool = False  # qwen3: RMSNorm over head_dim on q and k before rotary
    # Per layer: attend to at most this many most recent keys (None = full causal attention).
    sliding_windows: tuple[int | None, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    quantization: QuantizationConfig | None = None  # weight-only; None: the model dtype
    # Devices the params are laid out for (``for_tensor_parallel``): fused kernels are held
    # shard-major (spark_jax.ops.sharding); 1 is the checkpoint's layout.
    tensor_parallel: int = 1
    # The checkpoint's KV heads where the layout holds copies of them (0: no copies).
    checkpoint_kv_heads: int = 0

    @property
    def is_encoder_decoder(self) -> bool:
        return False

    def for_tensor_parallel(self, shards: int) -> ModelConfig:
        """This model laid out over ``shards`` devices. With fewer KV heads than shards each
        shard holds a copy of the one KV head its query heads read, so ``num_kv_heads`` counts
        the copies (``shards``): the same function of the weights, grouped N / shards."""
        _check_divides(shards, self.num_heads, "attention heads")
        _check_divides(shards, self.intermediate_size, "FFN columns (intermediate_size)")
        if self.num_kv_heads % shards and shards % self.num_kv_heads:
            raise ValueError(
                f"tensor_parallel={shards} must divide the {self.num_kv_heads} KV heads or be a "
                "multiple of them."
            )
        if shards == 1:
            return self
        copies = self.num_kv_heads < shards
        return dataclasses.replace(
            self,
            num_kv_heads=max(self.num_kv_heads, shards),
            tensor_parallel=shards,
            checkpoint_kv_heads=self.num_kv_heads if copies else 0,
        )

    def plain(self) -> ModelConfig:
        """The checkpoint's config of a model laid out for tensor parallelism (this one when it
        is not): what HF names and PEFT adapters describe."""
        if self.tensor_parallel == 1:
            return self
        return dataclasses.replace(
            self,
            num_kv_heads=self.checkpoint_kv_heads or self.num_kv_heads,
            tensor_parallel=1,
            checkpoint_kv_heads=0,
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    @property
    def num_params(self) -> int:
        """Parameter count, for bandwidth floors in benchmarks."""
        d, f = self.hidden_size, self.intermediate_size
        per_layer = d * self.qkv_size + self.q_size * d + 3 * d * f + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + d


@dataclass(frozen=True)
class NllbConfig:
    """The M2M100 / NLLB encoder-decoder."""

    model_type: str
    vocab_size: int
    d_model: int
    encoder_layers: int
    decoder_layers: int
    encoder_attention_heads: int
    decoder_attention_heads: int
    encoder_ffn_dim: int
    decoder_ffn_dim: int
    max_position_embeddings: int = 1024
    scale_embedding: bool = True
    activation_function: str = "relu"
    pad_token_id: int = 1
    bos_token_id: int = 0
    eos_token_id: int = 2
    decoder_start_token_id: int = 2
    layer_norm_eps: float = 1e-5
    tensor_parallel: int = 1  # devices the params are laid out for (``for_tensor_parallel``)

    @property
    def is_encoder_decoder(self) -> bool:
        return True

    def for_tensor_parallel(self, shards: int) -> NllbConfig:
        """This model laid out over ``shards`` devices (fused kernels shard-major)."""
        for heads in (self.encoder_attention_heads, self.decoder_attention_heads):
            _check_divides(shards, heads, "attention heads")
        for ffn in (self.encoder_ffn_dim, self.decoder_ffn_dim):
            _check_divides(shards, ffn, "FFN columns")
        return self if shards == 1 else dataclasses.replace(self, tensor_parallel=shards)

    def plain(self) -> NllbConfig:
        """The checkpoint's config of a model laid out for tensor parallelism."""
        return dataclasses.replace(self, tensor_parallel=1)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.eos_token_id,)


def _check_divides(shards: int, count: int, what: str) -> None:
    if shards < 1 or count % shards:
        raise ValueError(f"tensor_parallel={shards} must divide the {count} {what}.")


def _as_int_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(
            f"rope type {kind!r} is not supported; supported rope types are 'default', "
            "'linear' and 'llama3'."
        )
    fields: dict[str, Any] = {"theta": float(theta), "kind": kind}
    if kind in ("linear", "llama3"):
        fields["factor"] = float(merged["factor"])
    if kind == "llama3":
        fields["low_freq_factor"] = float(merged["low_freq_factor"])
        fields["high_freq_factor"] = float(merged["high_freq_factor"])
        fields["original_max_position_embeddings"] = int(
            merged.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
        )
    return RopeConfig(**fields)


def _sliding_windows(hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    model_type = hf["model_type"]
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
        window = None
    if window is None:
        return (None,) * num_layers
    if layer_types is None:
        if model_type == "mistral":
            layer_types = ["sliding_attention"] * num_layers
        else:
            first = hf.get("max_window_layers", num_layers)
            layer_types = [
                "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
            ]
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)


def _decoder_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    num_layers = int(hf["num_hidden_layers"])
    head_dim = hf.get("head_dim") or hidden // num_heads
    model_type = hf["model_type"]
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(hf),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
        qk_norm=model_type == "qwen3",
        sliding_windows=_sliding_windows(hf, num_layers),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_as_int_tuple(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
        quantization=quantization_from_hf(hf),
    )


def _nllb_config_from_hf(hf: dict[str, Any]) -> NllbConfig:
    names = {f.name for f in dataclasses.fields(NllbConfig)} - {"tensor_parallel"}
    fields = {k: v for k, v in hf.items() if k in names}
    fields["model_type"] = "m2m_100"
    activation = fields.get("activation_function", "relu")
    if activation != "relu":
        raise ValueError(
            f"activation_function {activation!r} is not supported for m2m_100; only 'relu' is."
        )
    return NllbConfig(**fields)


def config_from_hf(hf: dict[str, Any]) -> ModelConfig | NllbConfig:
    """Builds the config of a HuggingFace ``config.json`` dict; unknown model types are refused."""
    model_type = hf.get("model_type")
    if model_type in DECODER_MODEL_TYPES:
        return _decoder_config_from_hf(hf)
    if model_type in ENCODER_DECODER_MODEL_TYPES:
        return _nllb_config_from_hf(hf)
    raise ValueError(
        f"model_type {model_type!r} is not supported; supported model types are "
        f"{', '.join(SUPPORTED_MODEL_TYPES)}."
    )
