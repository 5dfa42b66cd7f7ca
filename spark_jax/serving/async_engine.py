"""The engine on a thread of its own, bridged to asyncio (vLLM's ``AsyncLLM`` in miniature).

``AsyncEngine`` owns one ``sj.Engine`` and one thread that steps it while any request is
unfinished and sleeps otherwise. Coroutines never call the engine: they send commands (add,
abort) that the thread runs between two steps, and they await the answer, so the event loop
never waits for a step. Each request's outputs arrive on an ``asyncio.Queue`` of the loop
that added it; one callback per step hands the loop all of that step's outputs.

Adding requests beyond ``max_queued`` waiting ones is refused with ``QueueFull``; a request
the engine refuses raises its ``ValueError``; a failed step ends every request in flight
with "error" (the engine's contract) and the thread keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from spark_jax.generation.beam import BeamRequest
from spark_jax.ops.sampling import SamplingParams
from spark_jax.serving.engine import Engine, EngineMetrics, RequestOutput

logger = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """More requests wait than the server admits; the client should retry later."""


Request = tuple[Sequence[int], SamplingParams] | BeamRequest


class AsyncEngine:
    """Steps ``engine`` on a thread; ``add`` / ``abort`` from any event loop."""

    def __init__(self, engine: Engine, max_queued: int = 1024):
        self.engine = engine
        self.max_queued = max_queued
        self._commands: list[Callable[[], None]] = []
        self._wake = threading.Condition()
        self._queues: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._stats = engine.metrics()
        self._thread = threading.Thread(target=self._loop, name="spark-jax-engine", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> EngineMetrics:
        """The engine's state after its last step (read without waiting for the thread)."""
        return self._stats

    async def add(self, requests: Sequence[Request]) -> tuple[list[int], asyncio.Queue]:
        """Queues every request or none: their ids, in order, and the one queue all their
        outputs arrive on."""
        loop = asyncio.get_running_loop()
        return await self._call(loop, lambda: self._add(loop, requests))

    def abort(self, request_ids: Sequence[int]) -> None:
        """Stops requests (those already ended are skipped); returns at once."""
        self._send(lambda: self._abort(request_ids))

    def shutdown(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(timeout=30)

    # -- the engine thread --------------------------------------------------------------------

    def _add(
        self, loop: asyncio.AbstractEventLoop, requests: Sequence[Request]
    ) -> tuple[list[int], asyncio.Queue]:
        waiting = self.engine.metrics().num_waiting
        if waiting + len(requests) > self.max_queued:
            raise QueueFull(
                f"{waiting} requests are already waiting (the server queues at most "
                f"{self.max_queued}); retry later."
            )
        added: list[int] = []
        try:
            for request in requests:
                if isinstance(request, BeamRequest):
                    added.append(self.engine.add_beam_request(request))
                else:
                    added.append(self.engine.add_request(*request))
        except BaseException:
            self._abort(added)
            raise
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        for request_id in added:
            self._queues[request_id] = (loop, queue)
        return added, queue

    def _abort(self, request_ids: Sequence[int]) -> None:
        for request_id in request_ids:
            self._queues.pop(request_id, None)
            self.engine.abort(request_id)

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._commands or self._stopping or self.engine.has_unfinished()):
                    self._wake.wait()
                if self._stopping:
                    return
                commands, self._commands = self._commands, []
            for command in commands:
                command()
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception:
                # The engine has ended every request with "error"; the next step reports them.
                logger.exception("an engine step failed; its requests end with an error")
                outputs = []
            self._stats = self.engine.metrics()
            self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            target = self._queues.get(out.request_id)
            if target is None:
                continue
            if out.finished:
                del self._queues[out.request_id]
            by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    # -- commands -----------------------------------------------------------------------------

    def _send(self, command: Callable[[], None]) -> None:
        with self._wake:
            self._commands.append(command)
            self._wake.notify()

    def _call(self, loop: asyncio.AbstractEventLoop, fn: Callable[[], Any]) -> asyncio.Future:
        """Runs ``fn`` on the engine thread; its result (or error) as a future of ``loop``."""
        future = loop.create_future()

        def command() -> None:
            try:
                result = fn()
            except Exception as error:  # handed to the caller, who answers with it
                loop.call_soon_threadsafe(self._settle, future, None, error)
            else:
                loop.call_soon_threadsafe(self._settle, future, result, None)

        self._send(command)
        return future

    def _settle(self, future: asyncio.Future, result: Any, error: Exception | None) -> None:
        if future.cancelled():  # the caller is gone: what it added has nobody to read it
            if result is not None:
                self.abort(result[0])
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)
