"""The serving engine's speculative decoding settings: vLLM's ``speculative_config``, checked.

``Engine(model, speculative_config={"method": "ngram", "num_speculative_tokens": K, ...})``
parses the dict here, once, into a frozen ``SpeculativeConfig``. The methods are the
drafters' names (``generation.drafters.DRAFTER_NAMES``); each method's own keys mirror
``make_drafter``'s arguments:

    "ngram"        prompt_lookup_max, prompt_lookup_min (vLLM's names: the n-gram lengths)
    "draft"        draft_model (a Model or a converted directory)
    "layer-skip"   skip_layers (the target's layers left out)
    "head"         draft_head (a head checkpoint file, or (params, block config))

The engine drafts with prompt lookup on the host, from each request's own tokens, or on the
device with a draft model, the target less some layers or a draft head, one cache row per
slot (``spark_jax.serving.drafting``). Any other key, or a key of another method, is refused
with the valid ones named.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spark_jax.generation.drafters import DRAFTER_NAMES, PromptLookupDrafter, make_drafter
from spark_jax.serving.drafting import HeadRows, LookupRows, ModelRows

METHOD_KEYS = {
    "ngram": ("prompt_lookup_max", "prompt_lookup_min"),
    "draft": ("draft_model",),
    "layer-skip": ("skip_layers",),
    "head": ("draft_head",),
}
COMMON_KEYS = ("method", "num_speculative_tokens")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates: ``num_speculative_tokens`` (K) drafts per step and row,
    verified by one width-(K + 1) step, proposed by ``method``."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    draft_model: Any = field(default=None, compare=False)  # a Model or a converted directory
    skip_layers: tuple[int, ...] = ()
    draft_head: Any = field(default=None, compare=False)  # a head file, or (params, config)

    @classmethod
    def parse(cls, config: Mapping[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """The checked settings of a ``speculative_config`` dict (one ValueError per mistake,
        naming what is valid)."""
        if isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, Mapping):
            raise ValueError(
                f"speculative_config must be a dict such as {{'method': 'ngram', "
                f"'num_speculative_tokens': 4}}, got {type(config).__name__}."
            )
        method = config.get("method")
        if method not in DRAFTER_NAMES:
            raise ValueError(
                f"unknown speculative method {method!r}; the methods are "
                f"{', '.join(repr(m) for m in DRAFTER_NAMES)}."
            )
        valid = COMMON_KEYS + METHOD_KEYS[method]
        unknown = sorted(set(config) - set(valid))
        if unknown:
            raise ValueError(
                f"speculative_config key(s) {', '.join(map(repr, unknown))} do not apply to "
                f"method {method!r}; its keys are {', '.join(map(repr, valid))}."
            )
        k = config.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(
                f"speculative_config needs num_speculative_tokens, an int >= 1, got {k!r}."
            )
        extra = {key: config[key] for key in METHOD_KEYS[method] if key in config}
        if method == "draft" and extra.get("draft_model") is None:
            raise ValueError(
                'method "draft" needs draft_model: a Model or a converted model directory.'
            )
        if method == "head" and extra.get("draft_head") is None:
            raise ValueError(
                'method "head" needs draft_head: a draft head checkpoint (save_draft_head\'s '
                "file) or (params, block config)."
            )
        if method == "layer-skip":
            skip = extra.get("skip_layers")
            if not skip or not all(isinstance(i, int) and not isinstance(i, bool) for i in skip):
                raise ValueError(
                    f'method "layer-skip" needs skip_layers, a list of the layer indices to '
                    f"leave out, got {skip!r}."
                )
            extra["skip_layers"] = tuple(skip)
        spec = cls(method, k, **extra)
        if method == "ngram":  # its own checks (the n-gram lengths), now rather than at a step
            PromptLookupDrafter(spec.prompt_lookup_max, spec.prompt_lookup_min)
        return spec

    def row_drafter(
        self, model: Any, executor: Any, max_model_len: int, chunk: int
    ) -> LookupRows | ModelRows | HeadRows:
        """The engine's drafter of these settings for ``model``: a row per slot of
        ``executor`` (a ``PagedExecutor``; a head reads its hidden states), of up to
        ``max_model_len`` tokens; a row's missing tokens are fed ``chunk`` a call."""
        k = self.num_speculative_tokens
        if self.method == "ngram":
            return LookupRows(PromptLookupDrafter(self.prompt_lookup_max, self.prompt_lookup_min))
        drafter = make_drafter(
            self.method, model, draft_model=self.draft_model, skip=self.skip_layers,
            head=self.draft_head,
        )  # fmt: skip
        if self.method == "head":
            return HeadRows(drafter, model, executor, max_model_len, k, chunk)
        vocab = model.config.vocab_size
        return ModelRows(drafter, vocab, executor.num_slots, max_model_len, k, chunk)
