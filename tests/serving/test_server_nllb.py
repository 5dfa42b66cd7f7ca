"""Translation through the server: ``/v1/completions`` on a tiny NLLB (random M2M100 weights,
a real sentencepiece tokenizer, converted by the project's converter) answers what the library
answers: greedy ``sj.generate`` and ``sj.generate_beam`` on ``encode_source(text)``; a burst
of beam requests is served co-batched."""

from __future__ import annotations

import asyncio
import io
import random

import helpers
import httpx
import pytest
import sentencepiece

import spark_jax as sj
from conversion.hf_to_orbax import convert
from spark_jax.serving.server import RunningServer, ServerOptions, build_app

TEXTS = ["the quick brown fox", "hello world again", "a lazy dog sleeps here"]


def _spm() -> bytes:
    words = "the quick brown fox jumps over a lazy dog hello world again sleeps here".split()
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(words) for _ in range(8)) for _ in range(300)]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=model, vocab_size=helpers.SPM_SIZE,
        model_type="bpe", minloglevel=2,
    )  # fmt: skip
    return model.getvalue()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> sj.Model:
    hf_dir = tmp_path_factory.mktemp("nllb_hf")
    helpers.tiny_hf(seed=3, eos_boost=1.0).save_pretrained(hf_dir)
    (hf_dir / "sentencepiece.bpe.model").write_bytes(_spm())
    return sj.load(convert(hf_dir, tmp_path_factory.mktemp("nllb") / "c", "float32", False))


@pytest.fixture(scope="module")
def server(model):
    engine = sj.Engine(model, max_num_seqs=8, max_model_len=24, max_num_beams=4)
    running = RunningServer(build_app(engine, ServerOptions("nllb"))).start()
    yield running
    running.stop()


def test_greedy_translation_equals_generate(server, model):
    for text in TEXTS:
        body = {"prompt": text, "tgt_lang": "fra_Latn", "max_tokens": 12, "temperature": 0}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
        src = model.tokenizer.encode_source(text, "eng_Latn")
        ref = sj.generate(
            model, src, sj.SamplingParams(temperature=0, max_tokens=12, tgt_lang="fra_Latn")
        )
        assert r["choices"][0]["text"] == ref.text
        assert r["usage"]["prompt_tokens"] == len(src)


def test_a_burst_of_beam_requests_equals_generate_beam(server, model):
    async def one(http, text):
        body = {"prompt": text, "src_lang": "eng_Latn", "tgt_lang": "deu_Latn", "n": 2}
        body |= {"num_beams": 3, "max_tokens": 10, "length_penalty": 0.8, "early_stopping": True}
        return (await http.post("/v1/completions", json=body)).json()

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            return await asyncio.gather(*(one(http, t) for t in TEXTS))

    answers = asyncio.run(main())
    requests = [
        sj.BeamRequest(model.tokenizer.encode_source(t, "eng_Latn"), tgt_lang="deu_Latn",
                       num_beams=3, max_new=10, length_penalty=0.8, num_return_sequences=2)
        for t in TEXTS
    ]  # fmt: skip
    for answer, result in zip(answers, sj.generate_beam(model, requests), strict=True):
        assert [c["text"] for c in answer["choices"]] == [
            model.tokenizer.decode(s) for s in result.sequences
        ]


def test_translation_refuses_chat_and_streamed_beams(server):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    body = {"prompt": "hi", "num_beams": 2, "stream": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    r = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "hi", "tgt_lang": "xx"}, timeout=30
    )
    assert r.status_code == 400 and "unknown language code" in r.json()["error"]["message"]
