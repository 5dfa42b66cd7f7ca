"""Closed-loop clients of the OpenAI-compatible server, for ``python -m benchmarks serving
--http``: the same requests and measures as ``serving.run_level``, through HTTP.

Each of ``concurrency`` workers streams one completion at a time (``/v1/completions``, the
prompt as token ids, greedy, EOS ignored, ``return_token_ids`` so a model without a tokenizer
still counts its tokens) and takes the next request when it ends. TTFT is from sending the
request to the first chunk with a token; TPOT from then to the last token, per token.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


async def _one(http: Any, model: str, prompt: list[int], n: int) -> dict[str, float]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    record: dict[str, float] = {"submit": time.perf_counter(), "prompt": len(prompt)}
    tokens = 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                got = len(choice.get("token_ids") or [])
                if got:
                    record.setdefault("first", time.perf_counter())
                    tokens += got
    record["end"], record["tokens"] = time.perf_counter(), tokens
    return record


async def _level(url: str, model: str, requests: list[tuple[list[int], int]], c: int) -> Any:
    import httpx

    queue = list(requests)
    done: list[dict[str, float]] = []
    limits = httpx.Limits(max_connections=c + 8, max_keepalive_connections=c + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        async def worker() -> None:
            while queue:
                prompt, n = queue.pop(0)
                done.append(await _one(http, model, prompt, n))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(c)))
        return done, time.perf_counter() - start


def run_http_level(
    url: str, model: str, requests: list[tuple[list[int], int]], concurrency: int
) -> tuple[list[dict[str, float]], float]:
    """The finished requests' records (submit, first, end, tokens, prompt) and the wall time.

    The clients run in a process of their own, as a real load generator does: in the
    server's process their parsing would take the interpreter lock from the server and the
    engine and be counted as the server's cost. Their clock (``perf_counter``, the system's
    monotonic clock) is the one the records are compared on."""
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "level.json"
        path.write_text(json.dumps({"url": url, "model": model, "requests": requests}))
        command = [sys.executable, "-m", "benchmarks.http_driver", str(path), str(concurrency)]
        subprocess.run(command, check=True, timeout=3600, cwd=Path(__file__).parent.parent)
        result = json.loads(path.read_text())
    return result["done"], result["wall"]


def main(argv: list[str]) -> None:
    """The client process: ``LEVEL_JSON CONCURRENCY``; writes the records into the file."""
    path, concurrency = Path(argv[0]), int(argv[1])
    level = json.loads(path.read_text())
    requests = [(list(p), int(n)) for p, n in level["requests"]]
    done, wall = asyncio.run(_level(level["url"], level["model"], requests, concurrency))
    path.write_text(json.dumps({"done": done, "wall": wall}))


if __name__ == "__main__":
    main(sys.argv[1:])
