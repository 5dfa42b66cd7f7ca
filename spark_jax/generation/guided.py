"""Guided decoding on the host: one llguidance matcher per constrained row, and their masks.

A request's ``SamplingParams.guided`` (``ops.sampling.GuidedDecodingParams``, already compiled
to an llguidance grammar) becomes a ``GuidedRow`` when the request is checked: the grammar
bound to the model's tokenizer, so a tokenizer the grammar cannot use is refused at submission
too. Each step a constrained row does two things, in this order:

    advance(token)   after the step's tokens reach the host (``RequestState.add`` calls it,
                     beside the stop rule: the row ends when its grammar is complete)
    fill             the row's allowed next tokens, written into the batch's mask
                     (``fill_bitmask``: llguidance's packed int32[B, ceil(V/32)], all ones on
                     free rows), which the jitted pick takes as an array input

The drivers fill the mask after dispatching the next step's forward and before its pick, so
the host's matcher work overlaps the device's forward. ``guided_from_request`` maps the
OpenAI / vLLM request fields onto the parameters, for the server.

llguidance is imported only where a request is guided, so the rest of the engine runs where
it is not installed.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from spark_jax.ops.sampling import GuidedDecodingParams, SamplingParams


class GuidedRow:
    """One row's grammar state: an llguidance matcher advanced by the tokens it was given."""

    def __init__(self, matcher: Any):
        self.matcher = matcher

    def advance(self, token: int) -> None:
        """Consumes one generated token (a token the grammar refuses leaves it in error)."""
        self.matcher.consume_token(token)

    @property
    def finished(self) -> bool:
        """The grammar is complete (nothing but EOS could follow), or the matcher failed."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        """Why the matcher failed ("" while it has not)."""
        return self.matcher.get_error()


@functools.lru_cache(maxsize=8)
def _llg_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Any:
    """The model's tokenizer as llguidance's (about a second to build for a 128k vocabulary,
    so once per tokenizer); ids from the tokenizer's vocabulary up to the model's are never
    allowed."""
    import llguidance

    if tokenizer is None:
        raise ValueError(
            "guided decoding needs the model's tokenizer; load the model with its tokenizer."
        )
    backend = tokenizer.backend_tokenizer
    if backend is None:
        raise ValueError(
            "guided decoding needs a tokenizer.json (HF tokenizers) tokenizer; this model's "
            "is a sentencepiece model."
        )
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
            f"{vocab_size}; guided decoding needs a mask bit for every token."
        )
    return llguidance.LLTokenizer(
        backend.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids)
    )


def guided_row(model: Any, params: SamplingParams) -> GuidedRow | None:
    """The request's grammar bound to ``model``'s tokenizer (None when it is not guided);
    ValueError when the tokenizer cannot serve it."""
    if params.guided is None:
        return None
    import llguidance

    tokenizer = _llg_tokenizer(model.tokenizer, model.config.vocab_size, model.eos_token_ids)
    # log_level 0: a matcher's failure is read through ``error``, not printed.
    matcher = llguidance.LLMatcher(tokenizer, params.guided.spec, log_level=0)
    if matcher.is_error():
        raise ValueError(f"guided decoding cannot start: {matcher.get_error()}")
    return GuidedRow(matcher)


@functools.lru_cache(maxsize=1)
def _executor() -> Any:
    """llguidance's thread pool for filling many rows' masks at once (one per process)."""
    import llguidance

    return llguidance.LLExecutor()


def bitmask_width(vocab_size: int) -> int:
    """Words of a row's mask: one bit per token, 32 to a word."""
    return -(-vocab_size // 32)


def fill_bitmask(guides: Sequence[GuidedRow | None], vocab_size: int) -> np.ndarray:
    """int32[len(guides), ceil(V/32)]: each running guided row's allowed next tokens, all ones
    on the other rows (free, finished, empty). A new array each call: the previous one may
    still feed a queued step."""
    bitmask = np.full((len(guides), bitmask_width(vocab_size)), -1, np.int32)
    rows = [(g.matcher, i) for i, g in enumerate(guides) if g is not None and not g.finished]
    if rows:
        from llguidance.numpy import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(_executor(), rows, bitmask)
    return bitmask


# ---------------------------------------------------------------------------------------------
# The request fields of the OpenAI API and of vLLM's.

_VLLM_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def guided_from_request(request: Mapping[str, Any]) -> GuidedDecodingParams | None:
    """The constraint an OpenAI / vLLM request body asks for, or None.

    Reads OpenAI's ``response_format`` ({"type": "text" | "json_object"} or {"type":
    "json_schema", "json_schema": {"schema": {...}}}) and vLLM's ``guided_json``,
    ``guided_regex``, ``guided_choice``, ``guided_grammar`` (with
    ``guided_whitespace_pattern``). ValueError naming the field for a malformed or invalid
    one, or when two of them are given.
    """
    asked: dict[str, dict[str, Any]] = {}
    response_format = request.get("response_format")
    if response_format is not None:
        asked |= _response_format(response_format)
    for field, kind in _VLLM_FIELDS.items():
        if request.get(field) is not None:
            asked[field] = {kind: request[field]}
    if len(asked) > 1:
        raise ValueError(f"{' and '.join(asked)} each ask for a constraint; give only one.")
    if not asked:
        return None
    ((field, kwargs),) = asked.items()
    whitespace = request.get("guided_whitespace_pattern")
    if whitespace is not None:
        kwargs["whitespace_pattern"] = whitespace
    try:
        return GuidedDecodingParams(**kwargs)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{field}: {error}") from None


def _response_format(value: Any) -> dict[str, dict[str, Any]]:
    """OpenAI's response_format as {field name: GuidedDecodingParams arguments}."""
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": {"json_object": True}}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, Mapping) or spec.get("schema") is None:
            raise ValueError(
                "response_format.json_schema must be an object holding the JSON schema under "
                "'schema'."
            )
        return {"response_format.json_schema.schema": {"json": spec["schema"]}}
    raise ValueError(
        f"response_format must have type 'text', 'json_object' or 'json_schema', got {value!r}."
    )
