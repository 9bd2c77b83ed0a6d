"""vLLM's ``AsyncLLM`` behind the blocking calls :class:`~twinkle.sampler.vLLMSampler` makes of ``vllm.LLM``.

``vLLMSampler(..., async_engine=True)`` runs on :class:`AsyncEngine`: the
engine core runs in its own process (always, for ``AsyncLLM``) and its client
on an event loop in a daemon thread of this process. Each prompt is an engine
request of its own, so the prompts of every caller in flight at once (threads
of one process, a server's concurrent requests) are scheduled into the same
engine steps: the engine batches them, not the caller. :meth:`AsyncEngine.stream`
yields a request's new tokens as they are generated (``sample_stream``).

Weights and adapters change under requests in flight safely: an adapter
version is removed from the engine only once the requests using it are done
(a new version always has a new id), and base weights are reloaded, and the
prefix cache reset, only when no request is in flight.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections import Counter
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from twinkle.data_format import StopReason

T = TypeVar("T")
_DONE = object()


@dataclass
class SampleChunk:
    """What :meth:`vLLMSampler.sample_stream` yields: new tokens of one completion since its last chunk.

    ``input_index`` is the input's position in ``inputs``, ``sample_index`` the
    completion's among its ``num_samples``; ``stop_reason`` is set on a
    completion's last chunk. Concatenating a completion's chunks gives the
    tokens and log-probs :meth:`~twinkle.sampler.Sampler.sample` returns for it.
    """

    input_index: int
    sample_index: int
    tokens: list[int]
    logprobs: list[float] | None
    stop_reason: StopReason | None = None


class AsyncEngine:
    """``AsyncLLM`` on an event loop of its own; see the module docstring.

    It answers the calls ``vLLMSampler`` makes of ``vllm.LLM`` (``generate``,
    ``collective_rpc``, ``reset_prefix_cache``, ``sleep``, ``wake_up``, and
    ``llm_engine.model_config`` / ``.vllm_config`` / ``.remove_lora``), blocking
    the calling thread only.
    """

    def __init__(self, engine_args: Mapping[str, Any]) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="twinkle-vllm-async", daemon=True)
        self._thread.start()
        self._ids = itertools.count()
        self._inflight: Counter[int] = Counter()  # LoRA id (0: none) -> requests in flight; loop thread only
        self._doomed: set[int] = set()  # LoRA ids to remove once their requests are done
        self._idle = asyncio.Event()
        self._idle.set()
        args = {"disable_log_stats": True, **engine_args}

        async def start() -> Any:  # the client's sockets and output task belong to this loop
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

        try:
            self.engine = self._run(start())
        except BaseException:
            self._stop_loop()
            raise
        self.model_config, self.vllm_config = self.engine.model_config, self.engine.vllm_config
        self.llm_engine = self  # what vLLMSampler reads of ``vllm.LLM.llm_engine`` is here too

    # ------------------------------------------------------------------ what vLLMSampler calls

    def generate(
        self, prompts: Sequence[Any], params: Any, lora_request: Any = None, use_tqdm: bool = False
    ) -> list[Any]:
        """Every prompt's final ``RequestOutput``, in order; the prompts run as concurrent engine requests.
        ``params`` and ``lora_request`` are one for every prompt, or a list with one per prompt (as ``LLM``'s)."""
        loras, every_params = _per_prompt(lora_request, len(prompts)), _per_prompt(params, len(prompts))

        async def every() -> list[Any]:
            finals = (self._final(*request) for request in zip(prompts, every_params, loras, strict=True))
            return list(await asyncio.gather(*finals))

        return self._run(every())

    def stream(self, prompts: Sequence[Any], params: Any, lora_request: Any = None) -> Iterator[tuple[int, Any]]:
        """``(prompt index, RequestOutput with the new tokens)`` as the engine generates them.

        Closing the iterator early aborts the requests still running.
        """
        from vllm.sampling_params import RequestOutputKind

        delta = params.clone()
        delta.output_kind = RequestOutputKind.DELTA
        loras = _per_prompt(lora_request, len(prompts))
        chunks: queue.Queue[Any] = queue.Queue()

        async def one(index: int, prompt: Any, lora: Any) -> None:
            async with self._using(lora):
                async for output in self.engine.generate(prompt, delta, self._request_id(), lora_request=lora):
                    chunks.put((index, output))

        async def every() -> None:
            try:
                await asyncio.gather(
                    *(one(index, p, lora) for index, (p, lora) in enumerate(zip(prompts, loras, strict=True)))
                )
            finally:
                chunks.put(_DONE)

        future = asyncio.run_coroutine_threadsafe(every(), self._loop)
        try:
            while (item := chunks.get()) is not _DONE:
                yield item
            future.result()  # an engine error ends the stream with that error
        finally:
            future.cancel()  # a no-op once done; else vLLM aborts the cancelled requests

    def collective_rpc(self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        """A worker method by name; ``twinkle_reload_weights`` waits until no request is in flight."""

        async def call() -> Any:
            if method == "twinkle_reload_weights":
                await self._idle.wait()
            return await self.engine.collective_rpc(method, args=args, kwargs=kwargs)

        return self._run(call())

    def remove_lora(self, lora_id: int) -> bool:
        """Remove adapter ``lora_id`` from the engine now, or once the requests using it are done."""

        async def remove() -> bool:
            if self._inflight[lora_id]:
                self._doomed.add(lora_id)
                return True
            return bool(await self.engine.remove_lora(lora_id))

        return self._run(remove())

    def reset_prefix_cache(self) -> bool:
        """Drop cached prompt prefixes once no request is in flight (vLLM cannot drop blocks in use)."""

        async def reset() -> bool:
            await self._idle.wait()
            return bool(await self.engine.reset_prefix_cache())

        return self._run(reset())

    def sleep(self, level: int = 1) -> None:
        self._run(self.engine.sleep(level))

    def wake_up(self) -> None:
        self._run(self.engine.wake_up())

    def shutdown(self) -> None:
        """Stop the engine core's process and this engine's event loop (idempotent)."""
        if self._loop.is_closed():
            return

        async def stop() -> None:  # on the loop, so that vLLM cancels its output task before the engine goes
            self.engine.shutdown()

        try:
            self._run(stop())
        finally:
            self._stop_loop()

    # ------------------------------------------------------------------ internals (event loop)

    async def _final(self, prompt: Any, params: Any, lora: Any) -> Any:
        final = None
        async with self._using(lora):
            async for output in self.engine.generate(prompt, params, self._request_id(), lora_request=lora):
                final = output
        return final

    def _using(self, lora: Any) -> _InFlight:
        return _InFlight(self, 0 if lora is None else lora.lora_int_id)

    async def _done(self, lora_id: int) -> None:
        self._inflight[lora_id] -= 1
        if not self._inflight[lora_id]:
            del self._inflight[lora_id]
            if lora_id in self._doomed:
                self._doomed.discard(lora_id)
                await self.engine.remove_lora(lora_id)
        if not self._inflight:
            self._idle.set()

    def _request_id(self) -> str:
        return f"twinkle-{next(self._ids)}"

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("AsyncEngine's blocking calls cannot be made from its own event loop")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()


class _InFlight:
    """Counts a request in flight under its LoRA id while it runs (on the engine's loop)."""

    def __init__(self, engine: AsyncEngine, lora_id: int) -> None:
        self.engine, self.lora_id = engine, lora_id

    async def __aenter__(self) -> None:
        self.engine._inflight[self.lora_id] += 1
        self.engine._idle.clear()

    async def __aexit__(self, *exc: object) -> None:
        await self.engine._done(self.lora_id)


def _per_prompt(value: Any, count: int) -> list[Any]:
    """A per-prompt argument (parameters, ``LoRARequest``) given once for all or as a list, one per prompt."""
    return list(value) if isinstance(value, (list, tuple)) else [value] * count
