"""Runs one benchmark suite: ``python -m benchmarks <suite> [--tiny] [--out FILE] [--against DIR]``.

Suites: decode, prefill, attention, serving, nllb, lora, speculative, startup, guided. Each measures
its figures and its peer in the same run, then prints one JSON line (suite, device, date,
figures, peers, ratios, notes) and a table; the line is also written to ``--out`` (default
``benchmarks/results/<suite>-<time>.json``) and to ``$OUT/<suite>.json`` when $OUT is set.

Peers that several suites share (``gpt_fast``) are modules run only as ``--peer-json`` children.
``--tiny`` runs tiny random shapes on any backend in seconds (peers that need a GPU are
skipped with a note). ``--against DIR`` runs the suite twice in child processes, first with
the checkout DIR's ``spark_jax`` first on sys.path, then with this tree's, peers left out,
and prints both side by side with the ratio new / old of every figure.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUITES = ("decode", "prefill", "attention", "serving", "nllb", "lora", "speculative", "startup")
PEERS = ("gpt_fast",)  # peer-only modules: run by a suite through --peer-json, never alone
SUITES += ("guided",)
REPO = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("suite", choices=SUITES + PEERS)
    parser.add_argument("--tiny", action="store_true", help="tiny random shapes, any backend")
    parser.add_argument("--out", default=None, help="where to write the JSON line")
    parser.add_argument("--against", default=None, help="an older checkout to run side by side")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="with --against: old and new alternate this many times; each figure is the median",
    )
    parser.add_argument("--no-peer", action="store_true", help="leave the peer out")
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=None,
        help="serving: the client concurrency levels to run (default: the plan's)",
    )
    parser.add_argument(
        "--requests", type=int, default=None, help="serving: finished requests per level"
    )
    parser.add_argument(
        "--num-scheduler-steps",
        type=int,
        default=None,
        metavar="N",
        help="serving: decode steps per device call when a step only decodes (default: the plan's)",
    )
    parser.add_argument(
        "--max-prefill-seqs",
        type=int,
        default=None,
        metavar="R",
        help="serving: the most rows of one prefill batch (default: the plan's, 4)",
    )
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        metavar="T",
        help="serving: the engine's step budget in tokens, riding decode rows included "
        "(default: the plan's, 1024)",
    )
    parser.add_argument(
        "--prefill-sizes",
        type=int,
        nargs="+",
        default=None,
        metavar="T",
        help="serving: the engine's prefill ladder, token totals ending at the step budget "
        "(sj.Engine(prefill_sizes=...); default: the plan's, every 128 tokens)",
    )
    parser.add_argument(
        "--prefill-batches",
        choices=("padded", "ragged", "mixed"),
        default=None,
        help="serving: the engine's prefill batches [B, T] (padded), ragged "
        "(sj.Engine(ragged_prefill=True)) or ragged with the decode rows riding in them "
        "(mixed_batches=True); default: the plan's (mixed)",
    )
    parser.add_argument(
        "--profile-concurrency",
        type=int,
        default=None,
        metavar="C",
        help="serving: the level profiled in a pass of its own (default: the plan's, 64)",
    )
    parser.add_argument(
        "--http",
        action="store_true",
        help="serving: the engine directly and through the HTTP server, side by side",
    )
    parser.add_argument(
        "--peers-from",
        default=None,
        metavar="DIR",
        help="serving: read the peers' results from DIR/<peer>.json (each written by "
        "`python -m benchmarks <peer suite> --peer-json DIR/<peer>.json` on this device just "
        "before) in place of running them",
    )
    parser.add_argument(
        "--quantize",
        nargs="+",
        default=None,
        choices=("fp8", "int8"),
        help="decode: also run these weight quantizations, beside the float model",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default=None,
        choices=("fp8",),
        help="decode: also run the batch case with this K/V cache type, beside the float one",
    )
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        default=1,
        metavar="N",
        help="decode: shard the model over the first N devices",
    )
    parser.add_argument("--tree", default=None, help=argparse.SUPPRESS)  # spark_jax from here
    parser.add_argument("--peer-json", default=None, help=argparse.SUPPRESS)  # child: peer only
    parser.add_argument("--peer-arg", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.suite in PEERS and not args.peer_json:
        parser.error(f"{args.suite} is a peer, not a suite: a suite runs it with --peer-json")
    return args


def run_child(suite: str, tiny: bool, tree: Path, out: Path, extra: list[str]) -> dict:
    """The suite in a child process with ``tree``'s spark_jax, peers left out."""
    command = [sys.executable, "-m", "benchmarks", suite, "--tree", str(tree), "--no-peer"]
    command += ["--out", str(out)] + (["--tiny"] if tiny else []) + list(extra)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{suite} against {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def against(args: argparse.Namespace) -> None:
    """Old tree then new, each in its own process (each takes the GPU alone)."""
    from benchmarks.common import print_table, write_json

    old_tree = Path(args.against).resolve()
    if not (old_tree / "spark_jax").is_dir():
        raise SystemExit(f"{old_tree} holds no spark_jax package")
    # Alternating rounds, so that the device's drift under sustained load (clocks) falls on
    # both trees alike.
    olds, news = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(max(1, args.rounds)):
            for trees, tree, name in ((olds, old_tree, "old"), (news, REPO, "new")):
                out = Path(scratch) / f"{name}{i}.json"
                trees.append(run_child(args.suite, args.tiny, tree, out, plan_args(args)))
    old, new = median_figures(olds), median_figures(news)
    ratios = {
        name: new["figures"][name] / value
        for name, value in old["figures"].items()
        if isinstance(value, int | float) and value and name in new["figures"]
    }
    line = {
        "suite": args.suite,
        "against": str(old_tree),
        "date": new["date"],
        "device": new["device"],
        "old": old,
        "new": new,
        "ratio_new_over_old": ratios,
    }
    write_json(line, f"{args.suite}-against", args.out)
    print(json.dumps(line, sort_keys=True, default=str), flush=True)
    print(f"old: {old['tree']} ({old['commit']}); new: {new['tree']} ({new['commit']})")
    print_table(
        ["figure", "old", "new", "new/old"],
        [[n, old["figures"][n], new["figures"].get(n), ratios.get(n)] for n in old["figures"]],
    )


def plan_args(args: argparse.Namespace) -> list[str]:
    """The plan overrides of the command line, as arguments for a child run."""
    out = []
    if args.concurrency:
        out += ["--concurrency", *map(str, args.concurrency)]
    if args.requests:
        out += ["--requests", str(args.requests)]
    if args.num_scheduler_steps:
        out += ["--num-scheduler-steps", str(args.num_scheduler_steps)]
    if args.max_prefill_seqs:
        out += ["--max-prefill-seqs", str(args.max_prefill_seqs)]
    if args.max_batch_tokens:
        out += ["--max-batch-tokens", str(args.max_batch_tokens)]
    if args.profile_concurrency:
        out += ["--profile-concurrency", str(args.profile_concurrency)]
    if args.prefill_sizes:
        out += ["--prefill-sizes", *map(str, args.prefill_sizes)]
    if args.prefill_batches:
        out += ["--prefill-batches", args.prefill_batches]
    if args.http:
        out += ["--http"]
    if args.quantize:
        out += ["--quantize", *args.quantize]
    if args.kv_cache_dtype:
        out += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.tensor_parallel != 1:
        out += ["--tensor-parallel", str(args.tensor_parallel)]
    return out


def plan_overrides(args: argparse.Namespace) -> dict:
    """The plan overrides of the command line, as keyword arguments of a suite's ``run``."""
    out = {}
    if args.concurrency:
        out["concurrency"] = tuple(args.concurrency)
    if args.requests:
        out["requests"] = args.requests
    if args.num_scheduler_steps:
        out["num_scheduler_steps"] = args.num_scheduler_steps
    if args.max_prefill_seqs:
        out["max_prefill_seqs"] = args.max_prefill_seqs
    if args.max_batch_tokens:
        out["max_batch_tokens"] = args.max_batch_tokens
    if args.profile_concurrency:
        out["profile_concurrency"] = args.profile_concurrency
    if args.prefill_sizes:
        out["prefill_sizes"] = tuple(args.prefill_sizes)
    if args.prefill_batches:
        out["ragged_prefill"] = args.prefill_batches != "padded"
        out["mixed_batches"] = args.prefill_batches == "mixed"
    if args.http:
        out["http"] = True
    if args.peers_from:
        out["peers_from"] = args.peers_from
    if args.quantize:
        out["quantize"] = tuple(args.quantize)
    if args.kv_cache_dtype:
        out["kv_cache_dtype"] = args.kv_cache_dtype
    if args.tensor_parallel != 1:
        out["tensor_parallel"] = args.tensor_parallel
    return out


def median_figures(lines: list[dict]) -> dict:
    """The first line with each numeric figure replaced by its median over ``lines``."""
    merged = dict(lines[0], figures=dict(lines[0]["figures"]), rounds=len(lines))
    for name, value in lines[0]["figures"].items():
        values = sorted(x["figures"].get(name) for x in lines if name in x["figures"])
        if isinstance(value, int | float) and all(isinstance(v, int | float) for v in values):
            n = len(values)
            merged["figures"][name] = (values[(n - 1) // 2] + values[n // 2]) / 2
    merged["all_rounds"] = [x["figures"] for x in lines]
    return merged


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.against:
        against(args)
        return
    if args.tree:  # before anything imports spark_jax: the tree under test comes first
        sys.path.insert(0, str(Path(args.tree).resolve()))
    from benchmarks.common import profile_as_run

    profile_as_run()  # before any suite starts jax's backend
    suite = importlib.import_module(f"benchmarks.{args.suite}")
    if args.peer_json:
        Path(args.peer_json).write_text(json.dumps(suite.peer(args.tiny, args.peer_arg)))
        return
    from benchmarks.common import print_table, result_line, write_json

    start = time.perf_counter()
    report = suite.run(args.tiny, peer=not args.no_peer, **plan_overrides(args))
    line = result_line(args.suite, args.tiny, report, time.perf_counter() - start)
    write_json(line, args.suite, args.out)
    print(json.dumps(line, sort_keys=True, default=str), flush=True)
    if report.table:
        print_table(report.table[0], report.table[1:])
    for note in report.notes:
        print(f"note: {note}")


if __name__ == "__main__":
    main()
