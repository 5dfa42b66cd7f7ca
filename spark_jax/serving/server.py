"""The OpenAI-compatible HTTP server over ``sj.Engine`` (FastAPI; run by ``python -m
spark_jax.serve``).

Routes: ``POST /v1/completions`` (text or token-id prompts; on an NLLB model the prompt is
the source text and the request may name ``src_lang``, ``tgt_lang``, ``num_beams``...),
``POST /v1/chat/completions`` (the checkpoint's chat template), ``GET /v1/models`` (the base
model and each LoRA adapter; a request's ``model`` picks one, vLLM's convention),
``GET /health`` and ``GET /metrics`` (Prometheus text).

The engine steps on its own thread (``AsyncEngine``); a handler validates its request on the
event loop, queues it and awaits its outputs. ``stream: true`` answers with server-sent events
in OpenAI's chunk format, ending with ``data: [DONE]``; a client that disconnects mid-stream
aborts its requests. Errors are OpenAI's JSON shape ``{"error": {"message", "type", "param",
"code"}}``: 400 for an invalid field (named in ``param``) or a prompt past the context, 401
without the API key, 404 for an unknown model, 503 when the waiting queue is full.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from spark_jax.generation.beam import BeamRequest, BeamResult
from spark_jax.ops.sampling import SamplingParams
from spark_jax.serving.async_engine import AsyncEngine, QueueFull
from spark_jax.serving.engine import Engine, RequestOutput
from spark_jax.serving.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequest,
    chat_logprobs,
    check_translation_fields,
    completion_logprobs,
    error_body,
    message_text,
    parse,
    prompts_of,
    sampling_params,
    usage,
)
from spark_jax.serving.server_metrics import ServerMetrics

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}
_ERROR_TYPES |= {503: "service_unavailable", 500: "internal_server_error"}


@dataclass(frozen=True)
class ServerOptions:
    """How the server answers: the names it serves, its key, its queue bound."""

    served_model_name: str = "default"
    api_key: str | None = None  # required as "Authorization: Bearer KEY" when set
    max_queued_requests: int = 1024  # waiting requests beyond this are answered 503


@dataclass
class _Choice:
    """One choice of a response as its outputs arrive."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    started: bool = False  # a streamed chat choice has sent its role


@dataclass
class _Generation:
    """A request's engine requests: choice i is ``ids[i]``, of prompt ``prompt_of[i]``."""

    ids: list[int]
    queue: Any
    prompt_tokens: list[int]  # tokens of each prompt, as the engine counts them
    prompt_of: list[int]
    beams: int = 0  # >0: one beam request per prompt, each giving ``beams`` choices


class _Server:
    """What the routes share: the engine, the model, the options, the metrics."""

    def __init__(self, engine: Engine, options: ServerOptions):
        self.engine = AsyncEngine(engine, options.max_queued_requests)
        self.model = engine.model
        self.max_model_len = engine.max_model_len
        self.options = options
        self.metrics = ServerMetrics(self.engine)
        self.created = int(time.time())

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @property
    def translates(self) -> bool:
        return bool(self.model.config.is_encoder_decoder)

    def adapters(self) -> list[str]:
        pool = self.model.lora_pool
        return [] if pool is None else [n for n in pool.names if n is not None]

    def authorize(self, request: Request) -> None:
        key = self.options.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise InvalidRequest(
                "a valid API key is required: send the header 'Authorization: Bearer KEY'.",
                status=401,
            )

    def adapter_of(self, model: str | None) -> str | None:
        """The adapter a request's ``model`` names (None: the base model)."""
        if model is None or model == self.options.served_model_name:
            return None
        if model in self.adapters():
            return model
        served = [self.options.served_model_name, *self.adapters()]
        raise InvalidRequest(
            f"the model {model!r} does not exist; this server serves {', '.join(served)}.",
            "model",
            status=404,
        )

    # -- prompts ------------------------------------------------------------------------------

    def completion_prompt(self, prompt: str | list[int]) -> list[int]:
        """A completion prompt's token ids (an NLLB text: its raw pieces, no specials)."""
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise InvalidRequest(
                "this model has no tokenizer: send the prompt as token ids.", "prompt"
            )
        return self.tokenizer.encode(prompt, add_special_tokens=not self.translates)

    def chat_prompt(self, request: ChatCompletionRequest) -> list[int]:
        if self.translates or self.tokenizer is None or not self.tokenizer.has_chat_template:
            raise InvalidRequest(
                "this model has no chat template; use /v1/completions instead.", "messages"
            )
        messages = [message_text(m) for m in request.messages]
        try:
            return self.tokenizer.encode_chat(messages)
        except Exception as error:  # the template's own raise_exception, or a render error
            raise InvalidRequest(f"messages: {error}", "messages") from None

    # -- submitting ---------------------------------------------------------------------------

    async def submit(
        self,
        prompts: list[list[int]],
        params: list[list[SamplingParams]],
        beam: CompletionRequest | None = None,
        prompt_field: str = "prompt",
    ) -> _Generation:
        """Queues the engine requests of every prompt: ``params[p]`` one per choice, or one
        beam search per prompt (``beam``: the request, when it asks for num_beams > 1)."""
        requests: list[Any] = []
        prompt_of: list[int] = []
        counted: list[int] = []
        for p, (prompt, choices) in enumerate(zip(prompts, params, strict=True)):
            if beam is not None:
                first = choices[0]
                request = BeamRequest(
                    prompt_tokens=prompt,
                    src_lang=first.src_lang,
                    tgt_lang=first.tgt_lang,
                    adapter=first.adapter,
                    num_beams=beam.num_beams,
                    max_new=first.max_tokens,
                    length_penalty=beam.length_penalty,
                    early_stopping=beam.early_stopping,
                    num_return_sequences=beam.n,
                )
                requests.append(request)
                prompt_of.append(p)
            else:
                requests += [(prompt, c) for c in choices]
                prompt_of += [p] * len(choices)
            counted.append(self._prompt_len(prompt, choices[0]))
        try:
            ids, queue = await self.engine.add(requests)
        except QueueFull as error:
            raise InvalidRequest(str(error), status=503) from None
        except ValueError as error:
            raise InvalidRequest(str(error), prompt_field) from None
        return _Generation(ids, queue, counted, prompt_of, beam.n if beam is not None else 0)

    def _prompt_len(self, prompt: list[int], params: SamplingParams) -> int:
        if not self.translates:
            return len(prompt)
        try:
            return len(self.model.runner.source_tokens(prompt, params))
        except ValueError as error:
            raise InvalidRequest(str(error), "prompt") from None

    # -- results ------------------------------------------------------------------------------

    def finished(self, gen: _Generation, out: RequestOutput, choices: list[_Choice]) -> None:
        """A finished engine request: its choice(s) completed, metrics recorded."""
        i = gen.ids.index(out.request_id)
        result = out.result
        if isinstance(result, BeamResult):
            eos = set(self.model.eos_token_ids)
            for j, seq in enumerate(result.sequences):
                choice = choices[i * gen.beams + j]
                choice.token_ids = list(seq)
                choice.text = self.tokenizer.decode(seq) if self.tokenizer is not None else ""
                choice.finish_reason = "stop" if seq and seq[-1] in eos else "length"
            if not result.sequences:
                for j in range(gen.beams):
                    choices[i * gen.beams + j].finish_reason = "error"
            tokens = sum(len(s) for s in result.sequences)
            reason = "stop" if result.sequences else "error"
            self.metrics.record(gen.prompt_tokens[gen.prompt_of[i]], tokens, reason, {})
            return
        choice = choices[i]
        choice.finish_reason = result.finish_reason
        choice.token_ids = list(result.output_tokens)
        if result.text is not None:
            choice.text = result.text
        self.metrics.record(
            result.num_prompt_tokens,
            len(result.output_tokens),
            result.finish_reason,
            result.timings,
        )

    def usage_of(self, gen: _Generation, choices: list[_Choice]) -> dict[str, int]:
        return usage(sum(gen.prompt_tokens), sum(len(c.token_ids) for c in choices))


def _error(error: InvalidRequest) -> JSONResponse:
    kind = _ERROR_TYPES.get(error.status, "invalid_request_error")
    code = "model_not_found" if error.status == 404 else error.status
    return JSONResponse(error_body(error.message, kind, error.param, code), error.status)


def _internal(error: Exception) -> JSONResponse:
    logger.exception("a request failed", exc_info=error)
    return _error(InvalidRequest(f"internal error: {error}", status=500))


async def _body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InvalidRequest(f"the request body is not valid JSON: {error}.") from None


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


def build_app(engine: Engine, options: ServerOptions | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``; it steps the engine on a thread of its own until
    the app shuts down."""
    options = options or ServerOptions()
    server = _Server(engine, options)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        server.engine.shutdown()

    app = FastAPI(title="spark_jax", lifespan=lifespan)
    app.state.server = server
    app.add_exception_handler(InvalidRequest, lambda request, error: _error(error))
    app.add_exception_handler(Exception, lambda request, error: _internal(error))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        server.authorize(request)
        base = options.served_model_name

        def card(name: str, parent: str | None) -> dict[str, Any]:
            return {
                "id": name,
                "object": "model",
                "created": server.created,
                "owned_by": "spark_jax",
                "root": name,
                "parent": parent,
                "max_model_len": server.max_model_len,
            }

        data = [card(base, None)] + [card(a, base) for a in server.adapters()]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        server.authorize(request)
        req = parse(CompletionRequest, await _body(request))
        adapter = server.adapter_of(req.model)
        _check_stream_options(req)
        check_translation_fields(req, server.translates)
        if req.logprobs is not None and server.translates and req.num_beams > 1:
            raise InvalidRequest("logprobs are not returned by beam search.", "logprobs")
        prompts = [server.completion_prompt(p) for p in prompts_of(req.prompt)]
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        src_lang = req.src_lang
        if server.translates and src_lang is None and isinstance(req.prompt, str | list):
            texts = any(isinstance(p, str) for p in prompts_of(req.prompt))
            src_lang = server.tokenizer.default_src_lang if texts else None
        choices_per_prompt = 1 if req.num_beams > 1 else req.n
        params = [
            [
                dataclasses.replace(
                    sampling_params(
                        req,
                        vocab_size=server.model.config.vocab_size,
                        max_tokens=max_tokens,
                        logprobs=req.logprobs,
                        adapter=adapter,
                        choice=j,
                    ),
                    src_lang=src_lang,
                )
                for j in range(choices_per_prompt)
            ]
            for _ in prompts
        ]
        beam = req if req.num_beams > 1 else None
        gen = await server.submit(prompts, params, beam)
        name = req.model or options.served_model_name
        if req.stream:
            return _streaming(_stream_completion(server, gen, req, name))
        choices = await _collect(server, gen)
        body = {
            "id": f"cmpl-{secrets.token_hex(12)}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": name,
            "choices": [
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": (
                        None
                        if req.logprobs is None
                        else completion_logprobs(server.tokenizer, c.logprobs)
                    ),
                    "finish_reason": c.finish_reason,
                    **({"token_ids": c.token_ids} if req.return_token_ids else {}),
                }
                for c in choices
            ],
            "usage": server.usage_of(gen, choices),
        }
        return JSONResponse(body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        server.authorize(request)
        req = parse(ChatCompletionRequest, await _body(request))
        adapter = server.adapter_of(req.model)
        _check_stream_options(req)
        prompt = server.chat_prompt(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true.", "top_logprobs")
        given = req.max_completion_tokens is not None
        max_tokens = req.max_completion_tokens if given else req.max_tokens
        if max_tokens is None:  # vLLM's default: the rest of the context
            max_tokens = max(1, server.max_model_len - len(prompt))
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = [
            sampling_params(
                req,
                vocab_size=server.model.config.vocab_size,
                max_tokens=max_tokens,
                logprobs=logprobs,
                adapter=adapter,
                choice=j,
            )
            for j in range(req.n)
        ]
        gen = await server.submit([prompt], [params], prompt_field="messages")
        name = req.model or options.served_model_name
        if req.stream:
            return _streaming(_stream_chat(server, gen, req, name))
        choices = await _collect(server, gen)
        body = {
            "id": f"chatcmpl-{secrets.token_hex(12)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": name,
            "choices": [
                {
                    "index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": (
                        chat_logprobs(server.tokenizer, c.logprobs) if req.logprobs else None
                    ),
                    "finish_reason": c.finish_reason,
                    **({"token_ids": c.token_ids} if req.return_token_ids else {}),
                }
                for c in choices
            ],
            "usage": server.usage_of(gen, choices),
        }
        return JSONResponse(body)

    return app


def _check_stream_options(req: Any) -> None:
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("stream_options needs stream: true.", "stream_options")


def _choices(gen: _Generation) -> list[_Choice]:
    count = len(gen.ids) * gen.beams if gen.beams else len(gen.ids)
    return [_Choice(i) for i in range(count)]


async def _outputs(server: _Server, gen: _Generation) -> AsyncIterator[RequestOutput]:
    """Every output of a generation's requests; those still running when the consumer stops
    (a client gone) are aborted. Outputs that queued up while the consumer was busy come
    merged, one per request (see ``_coalesce``)."""
    remaining = set(gen.ids)
    try:
        while remaining:
            ready = [await gen.queue.get()]
            while not gen.queue.empty():
                ready.append(gen.queue.get_nowait())
            for out in _coalesce(ready):
                if out.finished:
                    remaining.discard(out.request_id)
                yield out
    finally:
        if remaining:
            server.engine.abort(sorted(remaining))
            server.metrics.finished.labels(finished_reason="abort").inc(len(remaining))


def _coalesce(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Each request's consecutive outputs as one (tokens, text and logprobs joined; the end of
    the last), in order of each request's first. When the server falls behind the engine it
    then writes one event per request and step of its own instead of one per token, as
    vLLM's server does, so a busy server catches up instead of falling further behind."""
    merged: dict[int, RequestOutput] = {}
    for out in outputs:
        head = merged.get(out.request_id)
        if head is None:
            merged[out.request_id] = out
            continue
        logprobs = head.logprobs
        if out.logprobs is not None:
            logprobs = (logprobs or []) + out.logprobs
        merged[out.request_id] = RequestOutput(
            out.request_id,
            head.new_token_ids + out.new_token_ids,
            head.text_delta + out.text_delta,
            out.finished,
            out.result,
            logprobs,
        )
    return list(merged.values())


async def _collect(server: _Server, gen: _Generation) -> list[_Choice]:
    choices = _choices(gen)
    async for out in _outputs(server, gen):
        if out.logprobs and not gen.beams:
            choices[gen.ids.index(out.request_id)].logprobs += out.logprobs
        if out.finished:
            server.finished(gen, out, choices)
    failed = [c for c in choices if c.finish_reason in ("error", "abort")]
    if failed:
        raise InvalidRequest("the engine failed while generating; retry the request.", status=500)
    return choices


def _streaming(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream")


async def _stream_completion(
    server: _Server, gen: _Generation, req: CompletionRequest, name: str
) -> AsyncIterator[str]:
    choices = _choices(gen)
    head = {"id": f"cmpl-{secrets.token_hex(12)}", "object": "text_completion"}
    head |= {"created": int(time.time()), "model": name}
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    offsets = [0] * len(choices)
    async for out in _outputs(server, gen):
        i = gen.ids.index(out.request_id)
        if out.finished:
            server.finished(gen, out, choices)
        if not out.new_token_ids and not out.finished:
            continue
        choice: dict[str, Any] = {"index": i, "text": out.text_delta, "logprobs": None}
        if req.logprobs is not None and out.logprobs:
            choice["logprobs"] = completion_logprobs(server.tokenizer, out.logprobs, offsets[i])
        offsets[i] += len(out.text_delta)
        choice["finish_reason"] = _streamed_reason(choices[i]) if out.finished else None
        if req.return_token_ids:
            choice["token_ids"] = out.new_token_ids
        yield _sse({**head, "choices": [choice], **({"usage": None} if include_usage else {})})
        if out.finished and choices[i].finish_reason == "error":
            yield _sse(error_body("the engine failed while generating.", "internal_server_error"))
    if include_usage:
        yield _sse({**head, "choices": [], "usage": server.usage_of(gen, choices)})
    yield "data: [DONE]\n\n"


async def _stream_chat(
    server: _Server, gen: _Generation, req: ChatCompletionRequest, name: str
) -> AsyncIterator[str]:
    choices = _choices(gen)
    head = {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion.chunk"}
    head |= {"created": int(time.time()), "model": name}
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    extra = {"usage": None} if include_usage else {}
    async for out in _outputs(server, gen):
        i = gen.ids.index(out.request_id)
        if out.finished:
            server.finished(gen, out, choices)
        if not out.new_token_ids and not out.finished:
            continue
        if not choices[i].started:
            choices[i].started = True
            first = {"index": i, "delta": {"role": "assistant", "content": ""}}
            first |= {"logprobs": None, "finish_reason": None}
            yield _sse({**head, "choices": [first], **extra})
        choice: dict[str, Any] = {"index": i, "delta": {"content": out.text_delta}}
        choice["logprobs"] = (
            chat_logprobs(server.tokenizer, out.logprobs) if req.logprobs and out.logprobs else None
        )
        choice["finish_reason"] = _streamed_reason(choices[i]) if out.finished else None
        if req.return_token_ids:
            choice["token_ids"] = out.new_token_ids
        yield _sse({**head, "choices": [choice], **extra})
        if out.finished and choices[i].finish_reason == "error":
            yield _sse(error_body("the engine failed while generating.", "internal_server_error"))
    if include_usage:
        yield _sse({**head, "choices": [], "usage": server.usage_of(gen, choices)})
    yield "data: [DONE]\n\n"


def _streamed_reason(choice: _Choice) -> str | None:
    return choice.finish_reason if choice.finish_reason in ("stop", "length") else None


# ---------------------------------------------------------------------------------------------
# Running the app.


class RunningServer:
    """A uvicorn server on a thread (tests, benchmarks): ``url``, then ``stop()``."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.app = app
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_keep_alive=30)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True
        )

    def start(self, timeout_s: float = 30.0) -> RunningServer:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the server did not start on {self.url} in {timeout_s} s.")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.socket.close()


def serve(engine: Engine, options: ServerOptions, host: str, port: int) -> None:
    """Serves until interrupted (the CLI's loop)."""
    import uvicorn

    uvicorn.run(build_app(engine, options), host=host, port=port, log_level="info")


__all__: Sequence[str] = ("RunningServer", "ServerOptions", "build_app", "serve")
