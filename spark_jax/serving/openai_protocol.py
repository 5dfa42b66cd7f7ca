"""The OpenAI API's request bodies (pydantic) and their mapping onto ``sj.SamplingParams``.

Field names and meanings follow OpenAI's and vLLM's (``top_k``, ``min_p``,
``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``, ``min_tokens`` and
``return_token_ids`` are vLLM's extensions); translation adds ``src_lang``, ``tgt_lang``,
``num_beams``, ``length_penalty`` and ``early_stopping`` (HF ``generate``'s). Unknown fields
are refused rather than ignored, so a client never believes a feature took effect when it
did not. Every check names the field it failed on: ``InvalidRequest.param``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from spark_jax.generation.guided import guided_from_request
from spark_jax.ops.sampling import SamplingParams

MAX_N = 16  # choices per request


class InvalidRequest(ValueError):
    """A request the server refuses: ``message`` says why, ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    user: str | None = None  # accepted, ignored (OpenAI's end-user id)
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    # Structured output: OpenAI's response_format, or vLLM's guided_* fields (one of them).
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: a prompt as text, token ids, or a list of either."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    # Translation (NLLB): the prompt is the source text.
    src_lang: str | None = None
    tgt_lang: str | None = None
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = True


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: messages rendered by the checkpoint's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


TRANSLATION_FIELDS = ("src_lang", "tgt_lang", "num_beams", "length_penalty", "early_stopping")


def parse(kind: type[BaseModel], body: Any) -> Any:
    """The request body as ``kind``; InvalidRequest naming the first bad field."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object.")
    try:
        return kind.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        loc = [str(part) for part in first["loc"]]
        # Pydantic tries each member of a union and reports the last tried type in the path.
        loc = [p for p in loc if not re.fullmatch(r"(str|int|list\[.*\]|dict\[.*\]|bool)", p)]
        param = ".".join(loc) or None
        if first["type"] == "extra_forbidden":
            message = f"{param} is not a field this server knows; remove it."
        elif first["type"] == "missing":
            message = f"{param} is required."
        else:
            message = f"{param}: {first['msg']} (got {first.get('input')!r})."
        raise InvalidRequest(message, param) from None


def message_text(message: ChatMessage) -> dict[str, Any]:
    """One chat message as the chat template reads it: role and text content."""
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(
                    "messages: only text content parts ({'type': 'text', 'text': ...}) are "
                    "supported.",
                    "messages",
                )
            texts.append(part["text"])
        content = "".join(texts)
    out: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    return out


# Where a SamplingParams error names its own field, the request field it came from.
_CHAT_NAMES = {"logprobs": "top_logprobs"}


GUIDED_FIELDS = {
    "response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_whitespace_pattern",
}  # fmt: skip


def sampling_params(
    request: CompletionRequest | ChatCompletionRequest,
    *,
    vocab_size: int,
    max_tokens: int,
    logprobs: int | None,
    adapter: str | None,
    choice: int = 0,
) -> SamplingParams:
    """The request's SamplingParams for one choice (its seed is ``seed + choice``)."""
    bias: dict[int, float] = {}
    for key, value in (request.logit_bias or {}).items():
        if not re.fullmatch(r"\d+", key) or int(key) >= vocab_size:
            raise InvalidRequest(
                f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}.",
                "logit_bias",
            )
        bias[int(key)] = value
    for token in request.stop_token_ids or ():
        if not 0 <= token < vocab_size:
            raise InvalidRequest(
                f"stop_token_ids must be token ids in [0, {vocab_size}), got {token}.",
                "stop_token_ids",
            )
    seed = request.seed
    if seed is not None and seed >= 0:
        seed += choice
    fields = request.model_dump(include=GUIDED_FIELDS, exclude_none=True)
    try:
        guided = guided_from_request(fields) if fields else None
    except ValueError as error:
        message = str(error)
        param = next((f for f in GUIDED_FIELDS if message.startswith(f)), None)
        raise InvalidRequest(message, param) from None
    try:
        return SamplingParams(
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=-1 if request.top_k in (None, 0) else request.top_k,  # vLLM: 0 and -1 = off
            min_p=request.min_p or 0.0,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=(
                1.0 if request.repetition_penalty is None else request.repetition_penalty
            ),
            logit_bias=bias,
            seed=seed,
            stop=_stop_strings(request.stop),
            stop_token_ids=tuple(request.stop_token_ids or ()),
            ignore_eos=request.ignore_eos,
            min_tokens=request.min_tokens,
            max_tokens=max_tokens,
            logprobs=logprobs,
            adapter=adapter,
            src_lang=getattr(request, "src_lang", None),
            tgt_lang=getattr(request, "tgt_lang", None),
            guided=guided,
        )
    except (TypeError, ValueError) as error:
        message = str(error)
        param = _field_of(message, request)
        if param is not None and not message.startswith(param):  # the request's own name
            message = param + message[message.index(" ") :]
        raise InvalidRequest(message, param) from None


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _field_of(message: str, request: Any) -> str | None:
    """The request field a SamplingParams error message starts with."""
    match = re.match(r"[a-z_]+", message)
    if match is None:
        return None
    name = match.group(0)
    if isinstance(request, ChatCompletionRequest):
        if name == "max_tokens" and request.max_completion_tokens is not None:
            return "max_completion_tokens"
        return _CHAT_NAMES.get(name, name)
    return name


def check_translation_fields(request: CompletionRequest, translates: bool) -> None:
    """Translation fields on a model that does not translate, and beam-search limits."""
    if not translates:
        given = [f for f in TRANSLATION_FIELDS if f in request.model_fields_set]
        if given:
            raise InvalidRequest(
                f"{given[0]} applies only to translation (encoder-decoder) models; this model "
                "is decoder-only, so leave it out.",
                given[0],
            )
        return
    if request.num_beams < 1:
        raise InvalidRequest(f"num_beams must be >= 1, got {request.num_beams}.", "num_beams")
    if request.num_beams > 1:
        if request.stream:
            raise InvalidRequest(
                "stream is not supported with num_beams > 1: beam search returns finished "
                "hypotheses only.",
                "stream",
            )
        if request.n > request.num_beams:
            raise InvalidRequest(
                f"n ({request.n}) must be at most num_beams ({request.num_beams}).", "n"
            )


def prompts_of(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """A completion request's prompts: one text or id list, or a list of them."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt or isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def error_body(message: str, kind: str, param: str | None = None, code: Any = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def token_text(tokenizer: Any, token_id: int) -> str:
    """A token's own text, for logprobs (special tokens spelled out)."""
    return "" if tokenizer is None else tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: Any, records: Sequence[Any], offset: int = 0
) -> dict[str, list[Any]]:
    """The legacy completions ``logprobs`` object of some positions (``TokenLogprobs``)."""
    tokens = [token_text(tokenizer, r.token_id) for r in records]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [r.logprob for r in records],
        "top_logprobs": [{token_text(tokenizer, i): v for i, v in r.top.items()} for r in records],
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer: Any, records: Sequence[Any]) -> dict[str, list[Any]]:
    """The chat ``logprobs`` object (``{"content": [...]}``) of some positions."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {
                **entry(r.token_id, r.logprob),
                "top_logprobs": [entry(i, v) for i, v in r.top.items()],
            }
            for r in records
        ]
    }
