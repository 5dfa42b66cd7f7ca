"""The gpt-fast-style torch peer (benchmarks/gpt_fast.py) against HF transformers on the CPU:
logits after prefill and decode steps, greedy tokens of a left-padded static batch against
HF ``generate``, the useful-token count of ``static_batches``, and the peer's entry point."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from benchmarks import gpt_fast  # noqa: E402
from benchmarks.__main__ import main  # noqa: E402
from benchmarks.common import TINY_LLAMA  # noqa: E402
from spark_jax.config import config_from_hf  # noqa: E402
from tests.helpers import HF_BUILDERS, random_prompt  # noqa: E402

WIDE_STD = 0.1  # wider than HF's 0.02 init: logits spread out, so that 1e-4 is a sharp bound


def hf_model(name: str):
    torch.manual_seed(0)
    hf = HF_BUILDERS[name]().eval()
    with torch.no_grad():
        for param in hf.parameters():
            if param.dim() == 2:
                param.normal_(0.0, WIDE_STD)
    hf.set_attn_implementation("sdpa")
    return hf


def peer_of(hf, batch: int, max_len: int) -> gpt_fast.Runner:
    config = config_from_hf(hf.config.to_dict())
    model = gpt_fast.Transformer.from_hf(config, hf.state_dict()).eval()
    model.setup_caches(batch, max_len)
    return gpt_fast.Runner.of(model)


@pytest.mark.parametrize("name", ["llama3_untied", "llama_tied"])
def test_logits_after_prefill_and_decode_match_hf(name: str) -> None:
    hf = hf_model(name)
    model = peer_of(hf, batch=1, max_len=32).model
    prompt, fed = random_prompt(1, 9), random_prompt(2, 5)
    with torch.no_grad():
        expected = hf(torch.tensor([prompt + fed])).logits[0]
        pads = torch.zeros(1, dtype=torch.long)
        ids, slots = torch.tensor([prompt]), torch.arange(len(prompt))
        got = [model.logits(model(ids, slots, pads))[0]]
        for i, token in enumerate(fed[:-1]):
            slot = torch.tensor([len(prompt) + i])
            got.append(model.logits(model(torch.tensor([[token]]), slot, pads))[0])
    got = torch.cat(got)
    assert expected.std() > 0.5  # the bound below is not loose
    torch.testing.assert_close(got, expected[: len(got)], atol=1e-4, rtol=0)


def test_left_padded_static_batch_matches_hf_generate() -> None:
    hf = hf_model("llama3_untied")
    # 5 rows for 4 prompts: the spare row is filled and its output dropped
    runner = peer_of(hf, batch=5, max_len=40)
    prompts = [random_prompt(10 + i, n) for i, n in enumerate((3, 11, 6, 1))]
    new = 8
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = torch.tensor(prompt), 1
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    expected = out[:, width:].tolist()
    assert len({tuple(row) for row in expected}) == len(prompts)  # rows tell pads apart
    assert gpt_fast.generate(runner, prompts, new) == expected


def test_static_batches_counts_only_each_requests_tokens() -> None:
    requests = [
        (random_prompt(20 + i, n, 512), out)
        for i, (n, out) in enumerate([(5, 3), (9, 7), (2, 1), (4, 6), (7, 2)])
    ]
    result = gpt_fast.static_batches(TINY_LLAMA, requests, 2, "float32", "cpu", 64)
    assert result["useful_output_tokens"] == 3 + 7 + 1 + 6 + 2
    assert result["computed_output_tokens"] == 2 * 7 + 2 * 6 + 2 * 2  # the short last batch
    assert (result["requests"], result["batch"], result["device"]) == (5, 2, "cpu")
    assert result["output_tok_s"] == pytest.approx(19 / result["wall_s"])


def test_a_prompt_longer_than_the_cache_is_refused() -> None:
    runner = peer_of(hf_model("llama_tied"), batch=1, max_len=16)
    with pytest.raises(ValueError, match="exceed the cache"):
        gpt_fast.generate(runner, [random_prompt(3, 12)], 5)


def test_steps_trace_as_one_graph() -> None:
    """What CUDA compiles with fullgraph=True, traced here by dynamo without inductor."""
    hf = hf_model("llama3_untied")
    runner = peer_of(hf, batch=2, max_len=32)
    traced = gpt_fast.Runner(
        runner.model,
        torch.compile(gpt_fast.prefill, backend="eager", dynamic=True, fullgraph=True),
        torch.compile(gpt_fast.decode_one, backend="eager", fullgraph=True),
    )
    prompts = [random_prompt(4, 5), random_prompt(5, 8)]
    assert gpt_fast.generate(traced, prompts, 4) == gpt_fast.generate(runner, prompts, 4)


def test_peer_entry_is_registered(tmp_path) -> None:
    """What ``peer_in_subprocess("gpt_fast", tiny, ..., arg)`` runs in its child."""
    path = tmp_path / "peer.json"
    main(["gpt_fast", "--tiny", "--peer-json", str(path), "--peer-arg", "decode"])
    result = json.loads(path.read_text())
    assert result["device"] == "cpu" and result["bs1_tok_s"] > 0 and result["bs4_tok_s"] > 0
    with pytest.raises(SystemExit):
        main(["gpt_fast", "--tiny"])  # a peer, not a suite
