"""Each cheap benchmark suite runs on tiny shapes and prints one well-formed JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
KEYS = {"suite", "device", "date", "figures", "peers", "ratios", "notes", "tiny"}


def run_suite(suite: str, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / f"{suite}.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    env.pop("OUT", None)
    command = [sys.executable, "-m", "benchmarks", suite, "--tiny", "--out", str(out), *extra]
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"')]
    assert len(lines) == 1, proc.stdout
    line = json.loads(lines[0])
    assert line == json.loads(out.read_text())
    assert KEYS <= line.keys() and line["suite"] == suite and line["tiny"] is True
    assert line["figures"] and all(v > 0 for v in line["figures"].values())
    return line


def test_decode(tmp_path: Path) -> None:
    line = run_suite("decode", tmp_path, "--no-peer")
    assert {"bs1_tok_s", "bs4_tok_s"} <= line["figures"].keys()
    assert line["peers"]["bs1_floor_tok_s"] > 0


def test_decode_notes_a_kv_case_that_fails_and_keeps_the_others(monkeypatch) -> None:
    # A card that cannot hold one case's cache (the float one, on an 80 GB card once) must
    # not cost the run the other cases' figures, nor its table.
    import spark_jax as sj
    from benchmarks import decode

    real_model = sj.Model

    def model(*args, **kwargs):
        if kwargs.get("kv_cache_dtype") == "auto":
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory (simulated)")
        return real_model(*args, **kwargs)

    monkeypatch.setattr(sj, "Model", model)
    report = decode.run(tiny=True, peer=False, kv_cache_dtype="fp8")
    assert "kv_tok_s" not in report.figures and report.figures["kv_fp8_tok_s"] > 0
    assert report.ratios["kv_fp8_over_bf16"] is None
    assert any(note.startswith("kv: RuntimeError: RESOURCE_EXHAUSTED") for note in report.notes)
    kv_rows = [row for row in report.table if row[0].startswith("kv ")]
    assert [row[0] for row in kv_rows] == ["kv bs4 float32", "kv bs4 fp8", "kv bs4 fp8_xla"]
    assert kv_rows[0][1] is None and kv_rows[1][1] > 0


def test_attention(tmp_path: Path) -> None:
    line = run_suite("attention", tmp_path)
    assert "decode_tiny_ours_paged_tb_s" in line["figures"]
    assert not [n for n in line["notes"] if "disagree" in n]


@pytest.mark.slow
def test_serving(tmp_path: Path) -> None:
    line = run_suite("serving", tmp_path, "--no-peer")
    assert {"c1_tok_s", "c8_tok_s", "c1_steady_tok_s", "c8_steady_tok_s"} <= line["figures"].keys()
    assert {"bare_decode_bs1_ms", "bare_decode_bs8_ms"} <= line["peers"].keys()
    for c in (1, 8):  # the prompts' FLOPs lengthen the chain
        chain, with_prompts = (
            line["peers"][f"c{c}_{k}_tok_s"] for k in ("chain_bound", "chain_prompts")
        )
        assert 0 < with_prompts < chain
    for cache in ("on", "off"):  # each request's TTFT, whose median the figure is
        level = line["details"][f"shared_prefix_cache_{cache}"]
        assert len(level["ttft_ms"]) == level["requests"]
        median = float(np.median(level["ttft_ms"]))
        assert median == pytest.approx(level["ttft_s"]["p50"] * 1e3, abs=0.01)
    # The cache changes no token; and each level starts without it: C=8 runs C=1's requests,
    # which an earlier level's pages would have prefilled for free (read after both levels).
    on, off = (line["details"][f"shared_prefix_cache_{c}"]["output_digest"] for c in ("on", "off"))
    assert on == off and line["details"]["c1"]["output_digest"] != on
    assert line["details"]["metrics"]["cached_prompt_tokens"] == 0
    # Neither the engine nor the suite's own measurements (the bare steps) built a program
    # between warm-up and the last level timed on it.
    assert line["details"]["programs_built_after_warmup"] == 0


def test_serving_plan_flags_reach_the_suite_and_an_older_tree_alike() -> None:
    """The serving plan's command-line overrides become the suite's keyword arguments, and
    the arguments of the child run of ``--against`` give the same ones back."""
    from benchmarks.__main__ import parse_args, plan_args, plan_overrides

    argv = ["serving", "--concurrency", "64", "256", "--requests", "300"]
    argv += ["--num-scheduler-steps", "4", "--profile-concurrency", "256"]
    argv += ["--prefill-sizes", "256", "512", "1024"]
    args = parse_args([*argv, "--prefill-batches", "mixed", "--max-prefill-seqs", "8"])
    want = {"concurrency": (64, 256), "requests": 300, "num_scheduler_steps": 4}
    want |= {"max_prefill_seqs": 8, "prefill_sizes": (256, 512, 1024)}
    want |= {"profile_concurrency": 256, "ragged_prefill": True, "mixed_batches": True}
    assert plan_overrides(args) == want
    assert plan_overrides(parse_args(["serving", *plan_args(args)])) == plan_overrides(args)


def test_a_serving_plan_sized_in_pages_leaves_the_memory_share_out() -> None:
    """``kv_pages`` replaces ``gpu_memory_utilization`` (the engine refuses both at once)."""
    import dataclasses

    from benchmarks.serving import FULL

    assert FULL.engine_kwargs()["gpu_memory_utilization"] == FULL.gpu_memory_utilization
    assert "kv_pages" not in FULL.engine_kwargs()
    sized = dataclasses.replace(FULL, kv_pages=4096).engine_kwargs()
    assert sized["kv_pages"] == 4096 and "gpu_memory_utilization" not in sized


def test_serving_steady_state_leaves_out_the_start_and_the_drain() -> None:
    from benchmarks.serving import steady_state

    # Two clients; the queue runs dry at t=4 (last submit), the first finish is at t=1.
    done = [
        {"submit": 0.0, "end": 1.0},
        {"submit": 0.0, "end": 3.0},
        {"submit": 1.0, "end": 6.0},
        {"submit": 4.0, "end": 9.0},
    ]
    emitted = [(0.5, 100), (1.0, 2), (2.0, 2), (3.0, 2), (4.0, 2), (5.0, 1), (9.0, 1)]
    steady = steady_state(emitted, done)
    assert steady == {"steady_window_s": 3.0, "steady_output_tok_s": 6 / 3.0}
    # Every request submitted at the start: no client ever waited, no steady window.
    assert steady_state(emitted, [{"submit": 0.0, "end": 1.0}, {"submit": 0.0, "end": 2.0}]) == {}


@pytest.mark.slow
def test_nllb(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    line = run_suite("nllb", tmp_path)
    assert {"greedy_sent_s", "beam_sent_s"} <= line["figures"].keys()
    assert line["ratios"]["greedy_over_hf"] > 0
    assert line["details"]["greedy_agreement_with_hf"]["exact"] > 0


def test_guided(tmp_path: Path) -> None:
    line = run_suite("guided", tmp_path)
    assert {"guided_ms_step", "host_mask_ms_step"} <= line["figures"].keys()
    assert line["peers"]["free_ms_step"] > 0 and "guided_overhead" in line["ratios"]
    details = line["details"]
    assert details["guided_rows_constrained_to_the_end"] == details["guided_rows"]
    assert not line["notes"]


def test_device_idle_tells_gaps_between_programs_from_gaps_inside_one() -> None:
    """Kernels of every stream merged: a gap after program a's kernel and before a's next is
    inside a program; one where the program changes (the kernel that ended last before it
    against the next) is the device waiting between steps."""
    from benchmarks.serving import merged_gaps

    spans = [(0, 10, "a"), (12, 20, "a"), (25, 30, "b"), (28, 40, "b"), (50, 60, "a")]
    busy, gaps, between = merged_gaps(spans)
    assert (busy, gaps) == (43, [(10, 12), (20, 25), (40, 50)])
    assert between == [(20, 25, "a", "b"), (40, 50, "b", "a")]
    # A long kernel of a on one stream hides b's short one on another: a ended last.
    busy, gaps, between = merged_gaps([(0, 100, "a"), (10, 20, "b"), (110, 120, "a")])
    assert (busy, gaps, between) == (110, [(100, 110)], [])


def test_a_short_trace_lists_program_runs_and_what_the_host_did_between() -> None:
    """Each run of one program's kernels once, in the order they ran; the host's time inside
    a gap counted for every function it was in, and nothing outside the gaps."""
    from benchmarks.serving import _host_during, program_runs

    spans = [(1_000_000, 3_000_000, "a"), (2_000_000, 4_000_000, "a"), (6_000_000, 7_000_000, "b")]
    spans.append((7_500_000, 8_000_000, "a"))
    assert program_runs(spans, 1_000_000) == [("a", 0.0, 3.0), ("b", 5.0, 6.0), ("a", 6.5, 7.0)]
    host = [(3_000_000, 5_000_000, "dispatch"), (4_500_000, 6_500_000, "read")]
    during = _host_during(host, [(4_000_000, 6_000_000)])
    assert during == {"dispatch": 1_000_000, "read": 1_500_000}


def test_the_closed_loops_floor_is_its_longest_chain_of_requests() -> None:
    """Two clients: the first two requests start together, the third when the first ends
    (a step for its prompt, one a token); the level ends with the longest chain."""
    from benchmarks.serving import chain_steps

    requests = [([1], 3), ([1], 5), ([1], 4)]
    assert chain_steps(requests, 2) == 4 + 5  # the first ends at 4, the third 5 steps later
    assert chain_steps(requests, 3) == 6
    assert chain_steps(requests, 1) == 4 + 6 + 5


def test_serving_reads_peers_measured_before_and_says_so(tmp_path: Path) -> None:
    """``--peers-from DIR`` reads a peer's ``--peer-json`` file, says where and when it was
    written, and reports a missing one as an error rather than a figure."""
    from benchmarks.__main__ import parse_args, plan_overrides
    from benchmarks.serving import peer_from_file

    assert plan_overrides(parse_args(["serving", "--peers-from", str(tmp_path)])) == {
        "peers_from": str(tmp_path)
    }
    path = tmp_path / "hf_static_batches.json"
    path.write_text(json.dumps({"output_tok_s": 220.5, "device": "cuda"}))
    read = peer_from_file(str(path))
    assert read["output_tok_s"] == 220.5 and read["read_from"].startswith(f"{path}, written ")
    missing = peer_from_file(str(tmp_path / "gpt_fast_static_batches.json"))
    assert "output_tok_s" not in missing and "--peer-json" in missing["error"]


def test_profiles_trace_the_programs_as_they_run_keeping_the_users_flags(monkeypatch) -> None:
    from benchmarks.common import PROFILE_AS_RUN_FLAG, profile_as_run

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    profile_as_run()
    profile_as_run()  # once only, however often it is called
    assert os.environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {PROFILE_AS_RUN_FLAG}"
    monkeypatch.delenv("XLA_FLAGS")
    profile_as_run()
    assert os.environ["XLA_FLAGS"] == PROFILE_AS_RUN_FLAG
