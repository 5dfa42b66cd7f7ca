"""The OpenAI-compatible server, driven over HTTP on 127.0.0.1 by the official ``openai`` client
and by raw ``httpx``: its answers are the library's (``sj.generate`` on the same tokens).

One module-scoped server (a tiny random Llama with a byte-level BPE tokenizer and a chat
template, converted from a GGUF file by the project's converter, with two PEFT adapters)
serves every test; a second app over the same model holds an API key and a tiny queue.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import helpers
import httpx
import openai
import pytest

import spark_jax as sj
from conversion.hf_to_orbax import convert
from spark_jax.serving.server import RunningServer, ServerOptions, build_app

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
NAME = "tiny"
ENGINE = dict(max_num_seqs=16, max_batch_tokens=64, max_model_len=128)
GREEDY = dict(temperature=0.0, ignore_eos=True)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny_gguf")
    state = helpers.save_tiny_llama(directory / "hf")
    return helpers.write_tiny_gguf(directory / "tiny.gguf", state, chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def model(gguf_file, tmp_path_factory) -> sj.Model:
    from transformers import LlamaForCausalLM

    m = sj.load(convert(gguf_file, tmp_path_factory.mktemp("tiny") / "c", "float32", False))
    hf = LlamaForCausalLM.from_pretrained(gguf_file.parent / "hf").eval()
    m.enable_lora(max_adapters=2, max_rank=4)
    for seed, name in enumerate(["a", "b"]):
        peft = helpers.make_peft(hf, seed, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        path = tmp_path_factory.mktemp(name)
        peft.save_pretrained(path)
        m.add_adapter(name, path)
    return m


@pytest.fixture(scope="module")
def server(model):
    running = RunningServer(build_app(sj.Engine(model, **ENGINE), ServerOptions(NAME))).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def guarded(model):
    """A second app over the same model: an API key and a queue of two."""
    options = ServerOptions(NAME, api_key="sekret", max_queued_requests=2)
    running = RunningServer(build_app(sj.Engine(model, **ENGINE), options)).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def alone(model, ids, **params) -> sj.GenerationResult:
    return sj.generate(model, ids, sj.SamplingParams(**params))


def chat_ids(model, text: str) -> list[int]:
    return model.tokenizer.encode_chat([{"role": "user", "content": text}])


def post(server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120, **kwargs)


# --------------------------------------------------------------------------- acceptance 1


def test_greedy_completion_and_chat_equal_generate_with_exact_usage(client, model):
    r = client.completions.create(
        model=NAME, prompt="the cat", max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    ids = model.tokenizer.encode("the cat")
    ref = alone(model, ids, max_tokens=10, **GREEDY)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 10)

    c = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "hello there"}],
        max_completion_tokens=9,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    ids = chat_ids(model, "hello there")
    ref = alone(model, ids, max_tokens=9, **GREEDY)
    assert c.choices[0].message.content == ref.text
    assert c.choices[0].model_extra["token_ids"] == ref.output_tokens
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (len(ids), 9)
    assert c.usage.total_tokens == len(ids) + 9


def test_streamed_deltas_concatenate_to_the_unstreamed_text(client, server):
    kwargs = dict(model=NAME, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(prompt="stream me", **kwargs)
    chunks = list(
        client.completions.create(
            prompt="stream me", stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    messages = [{"role": "user", "content": "stream chat"}]
    chat = client.chat.completions.create(messages=messages, **kwargs)
    deltas = list(client.chat.completions.create(messages=messages, stream=True, **kwargs))
    assert deltas[0].choices[0].delta.role == "assistant"
    assert (
        "".join(d.choices[0].delta.content or "" for d in deltas) == chat.choices[0].message.content
    )
    # The raw stream: OpenAI's framing, ending with [DONE].
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json={"prompt": "x", "stream": True, "max_tokens": 3},
    ) as raw:
        lines = [line for line in raw.iter_lines() if line]
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


def test_n_3_with_a_seed_gives_three_reproducible_choices(client, model):
    kwargs = dict(model=NAME, prompt="seeded", n=3, seed=5, temperature=1.0, max_tokens=8)
    first = client.completions.create(**kwargs, extra_body={"return_token_ids": True})
    again = client.completions.create(**kwargs, extra_body={"return_token_ids": True})
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.text for c in again.choices] and len(set(texts)) == 3
    ids = model.tokenizer.encode("seeded")
    for i, choice in enumerate(first.choices):  # choice i draws with seed + i
        assert (
            choice.model_extra["token_ids"]
            == alone(model, ids, seed=5 + i, max_tokens=8).output_tokens
        )
    assert first.usage.completion_tokens == sum(
        len(c.model_extra["token_ids"]) for c in first.choices
    )


def test_several_prompts_as_texts_or_token_ids(server, model):
    texts = ["hi", "other"]
    ids = [model.tokenizer.encode(t) for t in texts]
    refs = [alone(model, p, max_tokens=4, **GREEDY).output_tokens for p in ids]
    for prompt in (texts, ids):
        body = {"prompt": prompt, "max_tokens": 4, **GREEDY, "return_token_ids": True}
        r = post(server, "/v1/completions", body).json()
        assert [c["token_ids"] for c in r["choices"]] == refs
        assert r["usage"]["prompt_tokens"] == sum(map(len, ids))


# --------------------------------------------------------------------------- acceptance 2

# Every field, a valid value, and the SamplingParams the library gives the same tokens with.
FIELD_CASES = [
    ({"temperature": 0.7, "seed": 3}, dict(temperature=0.7, seed=3)),
    ({"top_p": 0.5, "seed": 4}, dict(top_p=0.5, seed=4)),
    ({"top_k": 3, "seed": 5}, dict(top_k=3, seed=5)),
    ({"min_p": 0.9, "seed": 6}, dict(min_p=0.9, seed=6)),
    ({"presence_penalty": 1.5, **GREEDY}, dict(presence_penalty=1.5, **GREEDY)),
    ({"frequency_penalty": 1.0, **GREEDY}, dict(frequency_penalty=1.0, **GREEDY)),
    ({"repetition_penalty": 1.8, **GREEDY}, dict(repetition_penalty=1.8, **GREEDY)),
    ({"logit_bias": {"7": 100}, **GREEDY}, dict(logit_bias={7: 100.0}, **GREEDY)),
    ({"stop_token_ids": [7], "logit_bias": {"7": 100}, "temperature": 0},
     dict(stop_token_ids=(7,), logit_bias={7: 100.0}, temperature=0.0)),
    ({"min_tokens": 3, "stop_token_ids": [7], "logit_bias": {"7": 100}, "temperature": 0},
     dict(min_tokens=3, stop_token_ids=(7,), logit_bias={7: 100.0}, temperature=0.0)),
    ({"ignore_eos": True, "temperature": 0}, dict(ignore_eos=True, temperature=0.0)),
    ({"user": "someone", **GREEDY}, dict(**GREEDY)),
]  # fmt: skip


def test_every_sampling_field_gives_the_library_tokens(server, model):
    ids = model.tokenizer.encode("fields")
    for fields, params in FIELD_CASES:
        body = {"prompt": "fields", "max_tokens": 6, "return_token_ids": True, **fields}
        r = post(server, "/v1/completions", body)
        assert r.status_code == 200, (fields, r.text)
        choice = r.json()["choices"][0]
        ref = alone(model, ids, max_tokens=6, **params)
        assert choice["token_ids"] == ref.output_tokens, fields
        assert choice["finish_reason"] == ref.finish_reason, fields


def test_structured_output_through_response_format_and_the_guided_fields(client, server, model):
    choices = ["alpha", "beta", "gamma"]
    r = client.completions.create(
        model=NAME, prompt="pick", max_tokens=12, temperature=0.8, seed=3,
        extra_body={"guided_choice": choices},
    )  # fmt: skip
    assert r.choices[0].text in choices and r.choices[0].finish_reason == "stop"
    guided = sj.GuidedDecodingParams(choice=choices)
    ref = alone(model, model.tokenizer.encode("pick"), max_tokens=12, temperature=0.8, seed=3,
                guided=guided)  # fmt: skip
    assert r.choices[0].text == ref.text
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    r = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "json"}], max_tokens=40,
        temperature=0, response_format=fmt, extra_body={"guided_whitespace_pattern": ""},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)
    for bad, field in (
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, None),
        ({"response_format": {"type": "yaml"}}, "response_format"),
    ):
        r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, **bad})
        assert r.status_code == 400, (bad, r.text)
        if field is not None:
            assert r.json()["error"]["param"] == field, r.text


def test_stop_strings_and_max_tokens_aliases(client, model):
    ids = chat_ids(model, "stop")
    full = alone(model, ids, max_tokens=12, **GREEDY).text
    stop = full[3:5]
    assert len(full) > 5 and stop
    messages = [{"role": "user", "content": "stop"}]
    for given in (stop, [stop, "never-there"]):
        r = client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=12, temperature=0, stop=given,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert r.choices[0].message.content == full[: full.index(stop)]
        assert r.choices[0].finish_reason == "stop"


def test_logprobs_of_chat_and_completions_are_the_library_logprobs(client, model):
    ids = chat_ids(model, "lp")
    ref = alone(model, ids, max_tokens=4, logprobs=3, **GREEDY)
    r = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "lp"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx(
        [lp.logprob for lp in ref.logprobs], abs=1e-5
    )
    assert all(len(e.top_logprobs) == 3 for e in content)
    text_ids = model.tokenizer.encode("lp")
    ref = alone(model, text_ids, max_tokens=4, logprobs=2, **GREEDY)
    c = client.completions.create(
        model=NAME,
        prompt="lp",
        max_tokens=4,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert c.choices[0].logprobs.token_logprobs == pytest.approx(
        [lp.logprob for lp in ref.logprobs], abs=1e-5
    )
    assert all(len(top) <= 2 for top in c.choices[0].logprobs.top_logprobs)


INVALID = [
    ("temperature", -1),
    ("temperature", "hot"),
    ("top_p", 0),
    ("top_k", -5),
    ("min_p", 2),
    ("presence_penalty", 3),
    ("frequency_penalty", -3),
    ("repetition_penalty", 0),
    ("stop", 5),
    ("stop", [""]),
    ("stop_token_ids", [10**6]),
    ("seed", -1),
    ("n", 0),
    ("n", 100),
    ("logprobs", 50),
    ("logit_bias", {"x": 1}),
    ("logit_bias", {"5": 500}),
    ("logit_bias", {"99999": 1}),
    ("ignore_eos", "maybe"),
    ("min_tokens", 99),
    ("max_tokens", 0),
    ("user", 5),
    ("stream_options", {"include_usage": True}),
    ("src_lang", "eng_Latn"),
    ("num_beams", 4),
    ("unknown_field", 1),
]
CHAT_INVALID = [("top_logprobs", 50), ("max_completion_tokens", 0), ("messages", [])]


def test_each_invalid_field_gets_a_400_naming_it_and_requests_in_flight_finish(server, model):
    ids = model.tokenizer.encode("in flight")
    ref = alone(model, ids, max_tokens=40, **GREEDY)
    streamed: list[str] = []

    def in_flight():
        body = {"prompt": "in flight", "max_tokens": 40, "stream": True, **GREEDY}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
            streamed.extend(line for line in r.iter_lines() if line)

    thread = threading.Thread(target=in_flight)
    thread.start()
    for path, cases, base in [
        ("/v1/completions", INVALID, {"prompt": "x"}),
        ("/v1/chat/completions", CHAT_INVALID, {"messages": [{"role": "user", "content": "x"}]}),
    ]:
        for name, value in cases:
            extra = {"logprobs": True} if name == "top_logprobs" else {}
            r = post(server, path, {**base, **extra, name: value})
            assert r.status_code == 400, (name, value, r.text)
            error = r.json()["error"]
            assert error["param"] == name and name in error["message"], (name, error)
            assert set(error) == {"message", "type", "param", "code"}
    thread.join(timeout=120)
    text = "".join(
        json.loads(line[6:])["choices"][0]["text"]
        for line in streamed[:-1]
        if line[6:].startswith("{")
    )
    assert streamed[-1] == "data: [DONE]" and text == ref.text


def test_unknown_model_long_prompt_bad_json_and_chat_on_token_ids(server, client):
    r = post(server, "/v1/completions", {"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=NAME, prompt=list(range(200)), max_tokens=4)
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", {"prompt": [5, 10**6], "max_tokens": 2})
    assert r.status_code == 400 and "outside" in r.json()["error"]["message"]


def test_the_api_key_and_the_bounded_queue(guarded):
    assert httpx.get(f"{guarded.url}/v1/models").status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    r = httpx.get(f"{guarded.url}/v1/models", headers=wrong)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    ok = {"Authorization": "Bearer sekret"}
    assert httpx.get(f"{guarded.url}/v1/models", headers=ok).status_code == 200
    body = {"prompt": "q", "max_tokens": 2, "n": 3, **GREEDY}
    r = post(guarded, "/v1/completions", body, headers=ok)
    assert r.status_code == 503 and "retry later" in r.json()["error"]["message"]
    assert post(guarded, "/v1/completions", {**body, "n": 2}, headers=ok).status_code == 200
    assert httpx.get(f"{guarded.url}/health").status_code == 200  # not behind the key


# --------------------------------------------------------------------------- acceptance 3


def _metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))


def test_100_streaming_clients_20_of_which_disconnect(server, model):
    prompts = [f"client {i % 4}" for i in range(4)]
    refs = [alone(model, model.tokenizer.encode(p), max_tokens=16, **GREEDY).text for p in prompts]

    async def one(http: httpx.AsyncClient, i: int) -> str | None:
        # A leaver asks for many tokens, so that it leaves while its request still runs (one
        # event can carry several tokens when the server falls behind the engine).
        leaves = i % 5 == 0
        tokens = 110 if leaves else 16  # the context holds 128
        body = {"prompt": prompts[i % 4], "max_tokens": tokens, "stream": True, **GREEDY}
        text, events = "", 0
        async with http.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                events += 1
                text += json.loads(line[6:])["choices"][0]["text"]
                if leaves and events == 2:
                    return None  # leaves mid-stream: the connection closes
        return text

    async def main():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
            return await asyncio.wait_for(asyncio.gather(*(one(http, i) for i in range(100))), 240)

    texts = asyncio.run(main())
    kept = [(i, t) for i, t in enumerate(texts) if i % 5]
    assert len(kept) == 80 and all(t == refs[i % 4] for i, t in kept)
    deadline = time.monotonic() + 30
    while _metric(server, "spark_jax:num_requests_running") or _metric(
        server, "spark_jax:kv_pages_in_use"
    ):
        assert time.monotonic() < deadline, "requests still held after every client left"
        time.sleep(0.1)
    assert _metric(server, "spark_jax:num_requests_waiting") == 0
    assert _metric(server, 'spark_jax:request_success_total{finished_reason="abort"}') >= 20
    assert _metric(server, "spark_jax:time_to_first_token_seconds_count") >= 80
    # The prefix cache's gauge is the engine's own figure.
    engine = server.app.state.server.engine.engine
    rate = engine.metrics().prefix_cache_hit_rate
    assert _metric(server, "spark_jax:prefix_cache_hit_rate") == pytest.approx(rate)


# --------------------------------------------------------------------------- acceptance 4


def test_models_lists_the_adapters_and_a_mixed_burst_equals_the_library(client, server, model):
    assert [m.id for m in client.models.list().data] == [NAME, "a", "b"]
    names = [NAME, "a", "b"] * 4
    prompts = [f"adapter {i}" for i in range(len(names))]

    async def one(http, name, prompt):
        body = {
            "model": name,
            "prompt": prompt,
            "max_tokens": 8,
            "return_token_ids": True,
            **GREEDY,
        }
        return (await http.post("/v1/completions", json=body)).json()["choices"][0]["token_ids"]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            return await asyncio.gather(
                *(one(http, n, p) for n, p in zip(names, prompts, strict=True))
            )

    got = asyncio.run(main())
    for name, prompt, tokens in zip(names, prompts, got, strict=True):
        adapter = None if name == NAME else name
        ref = alone(model, model.tokenizer.encode(prompt), max_tokens=8, adapter=adapter, **GREEDY)
        assert tokens == ref.output_tokens, name
    base = alone(model, model.tokenizer.encode(prompts[1]), max_tokens=8, **GREEDY)
    assert got[1] != base.output_tokens  # the adapter acts


# --------------------------------------------------------------------------- the CLIs


def test_the_serve_cli_converts_a_gguf_and_answers_like_the_library(gguf_file, model, tmp_path):
    """The server speculates (``--speculative-config``, vLLM's flag) and still answers with
    the library's greedy tokens; /metrics then counts its drafts."""
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", SPARK_JAX_CACHE=str(tmp_path))
    with socket.socket() as s:  # a free port: bind one, then free it for the server
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "spark_jax.serve", "--model", str(gguf_file), "--port", str(port)]
    argv += ["--skip-warmup", "--max-num-seqs", "2", "--compilation-cache", ""]
    argv += ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}']
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the server did not come up in 120 s"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        body = {"prompt": "cli", "max_tokens": 5, "return_token_ids": True, **GREEDY}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120).json()
        ref = alone(model, model.tokenizer.encode("cli"), max_tokens=5, **GREEDY)
        assert r["choices"][0]["token_ids"] == ref.output_tokens
        assert r["model"] == str(gguf_file)
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert "spark_jax:spec_decode_num_draft_tokens" in metrics
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_serve_cli_passes_the_engine_options_and_refuses_what_the_device_lacks(
    gguf_file, tmp_path, monkeypatch
):
    """``--num-scheduler-steps`` and ``--gpu-memory-utilization`` (vLLM's flags) reach the
    engine; a device that reports no memory limit (the CPU) is one line, no traceback."""
    from spark_jax.serve import _parser, build_engine, main

    monkeypatch.setenv("SPARK_JAX_CACHE", str(tmp_path))
    argv = ["--model", str(gguf_file), "--compilation-cache", "", "--max-num-seqs", "2"]
    engine, _ = build_engine(_parser().parse_args([*argv, "--num-scheduler-steps", "4"]), {})
    assert engine.num_scheduler_steps == 4 and engine.executor.num_scheduler_steps == 4
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--skip-warmup", "--gpu-memory-utilization", "0.9"])
    assert str(stop.value).startswith("error: the cpu device reports no memory limit")


def test_a_speculative_config_that_is_not_a_json_object_is_refused(capsys):
    from spark_jax.serve import main

    for text, says in (("{method: ngram}", "not JSON"), ('["ngram"]', "a JSON object")):
        with pytest.raises(SystemExit) as stop:
            main(["--speculative-config", text])
        assert stop.value.code == 2
        assert f"--speculative-config: {says}" in capsys.readouterr().err


@pytest.mark.parametrize("module", ["spark_jax.serve", "spark_jax.generate"])
def test_a_missing_model_is_one_line_without_a_traceback(module):
    argv = [sys.executable, "-m", module, "--model", "/nonexistent", "--compilation-cache", ""]
    argv += ["--prompt", "hi"] if module == "spark_jax.generate" else []
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "error: --model /nonexistent: no such file or directory; give a converted directory, an "
        "HF model directory or a .gguf file."
    ]


def test_translation_flags_on_a_decoder_model_are_refused(gguf_file, tmp_path, monkeypatch, capsys):
    from spark_jax.generate import main

    monkeypatch.setenv("SPARK_JAX_CACHE", str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(gguf_file), "--tgt-lang", "fra_Latn", "--prompt", "hi",
              "--compilation-cache", ""])  # fmt: skip
    assert exit_info.value.code == 2
    assert "--tgt-lang applies to translation (NLLB) models" in capsys.readouterr().err
