"""The serving engine's speculative decoding settings: vLLM's ``speculative_config``, checked.

``Engine(model, speculative_config={"method": "ngram", "num_speculative_tokens": K, ...})``
parses the dict here, once, into a frozen ``SpeculativeConfig``. The methods are the
drafters' names (``generation.drafters.DRAFTER_NAMES``); each method's own keys mirror
``make_drafter``'s arguments:

    "ngram"        prompt_lookup_max, prompt_lookup_min (vLLM's names: the n-gram lengths)
    "draft"        draft_model (a Model or a converted directory)
    "layer-skip"   skip_layers (the target's layers left out)
    "head"         draft_head (a head checkpoint file, or (params, block config))

The engine drafts with prompt lookup on the host, from each request's own tokens (the other
methods run in ``sj.generate_speculative`` for now, one sequence per call). Any other key,
or a key of another method, is refused with the valid ones named.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from spark_jax.generation.drafters import DRAFTER_NAMES, PromptLookupDrafter

ENGINE_METHODS = ("ngram",)  # the methods the engine runs (the rest: generate_speculative)
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
        if method not in ENGINE_METHODS:
            raise ValueError(
                f"the engine speculates with {', '.join(map(repr, ENGINE_METHODS))} so far; "
                f"method {method!r} runs in sj.generate_speculative (one sequence per call)."
            )
        k = config.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(
                f"speculative_config needs num_speculative_tokens, an int >= 1, got {k!r}."
            )
        extra = {key: config[key] for key in METHOD_KEYS[method] if key in config}
        spec = cls(method, k, **extra)
        spec.drafter()  # its own checks (the n-gram lengths), now rather than at a step
        return spec

    def drafter(self) -> PromptLookupDrafter:
        """The host drafter of these settings (stateless: one serves every request)."""
        return PromptLookupDrafter(self.prompt_lookup_max, self.prompt_lookup_min)
