"""``TwinkleClient``: one connection to a Twinkle server's native API (``/twinkle/v1``).

Bodies go out in the wire codec (:mod:`twinkle.wire`); replies are decoded from
wire or JSON; error replies raise the ``twinkle.errors`` class the server named
(:mod:`twinkle_client.remote_errors`).

Retries only where repeating cannot do anything twice: a request that never
reached the server (connection refused or timed out), GETs (futures are
long-polled), and POSTs that carry an ``idempotency_key`` — the key is made once
per logical call and the same bytes are re-sent, so the server can answer a
repeat from its record. A POST without a key (create a session, a run, a
dataset; draw the next batch) is never re-sent once it may have arrived.

The first use opens a server session and a daemon thread that keeps it alive;
``close()`` (also a ``with`` block's end, and interpreter exit) stops the thread
and ends the session, which releases its adapters on the server (checkpoints stay).
"""

from __future__ import annotations

import atexit
import json
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

import httpx

from twinkle import wire
from twinkle.errors import ServerError, TwinkleError
from twinkle.utils import get_logger
from twinkle_client.remote_errors import error_from_body, error_from_response

logger = get_logger(__name__)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
API_PREFIX = "/twinkle/v1"
RETRY_STATUSES = frozenset({429, 502, 503, 504})  # the server (or a proxy) asks to come back later
LONG_POLL_SECONDS = 30
MIN_POLL_INTERVAL = 0.2  # a server that answers "pending" at once is not polled in a tight loop
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


class TwinkleClient:
    """Requests, retries, futures and the session of one server; see the module docstring.

    ``transport`` replaces httpx's network transport (e.g. ``httpx.MockTransport`` in tests).
    """

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        api_key: str | None = None,
        timeout: float = 60.0,
        *,
        heartbeat_interval: float = 20.0,
        max_retries: int = 4,
        retry_backoff: float = 0.5,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        root = base_url.rstrip("/")
        self.base_url = root if root.endswith(API_PREFIX) else root + API_PREFIX
        self.timeout = timeout
        self.heartbeat_interval = heartbeat_interval
        self.max_retries = max_retries
        self.retry_backoff = retry_backoff
        headers = {"Accept": f"{wire.CONTENT_TYPE}, application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, transport=transport)
        self._lock = threading.Lock()
        self._session_id: str | None = None
        self._heartbeat: _Heartbeat | None = None
        self._server_info: dict[str, Any] | None = None
        # adapter name -> run id (the latest added in this process wins): lets samplers resolve adapter names
        self.adapter_runs: dict[str, str] = {}
        atexit.register(self.close)

    # ------------------------------------------------------------------ requests

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: dict[str, Any] | None = None,
        retry_safe: bool | None = None,
        timeout: float | None = None,
        max_retries: int | None = None,
    ) -> Any:
        """Send one logical request and return its decoded reply.

        ``retry_safe`` defaults to ``method == "GET"``; pass ``True`` only for a
        body with an idempotency key. Connection failures before sending are
        retried regardless.
        """
        safe = method == "GET" if retry_safe is None else retry_safe
        retries = self.max_retries if max_retries is None else max_retries
        content = None if body is None else wire.encode(body)
        headers = {} if content is None else {"Content-Type": wire.CONTENT_TYPE}
        attempt = 0
        while True:
            final = attempt >= retries
            try:
                response = self._http.request(
                    method, path, content=content, headers=headers, params=params, timeout=timeout or self.timeout
                )
            except _NOT_SENT as exc:
                if final:
                    raise ServerError(f"cannot reach the Twinkle server at {self.base_url}: {exc!r}") from exc
                delay = self._backoff(attempt)
            except httpx.TransportError as exc:  # it may have arrived: only a safe request goes again
                if final or not safe:
                    raise ServerError(f"{method} {path} failed after the request was sent: {exc!r}") from exc
                delay = self._backoff(attempt)
            else:
                if final or not safe or response.status_code not in RETRY_STATUSES:
                    return _reply(response)
                delay = _retry_after(response) or self._backoff(attempt)
            attempt += 1
            logger.debug("retrying %s %s in %.2f s (retry %d of %d)", method, path, delay, attempt, retries)
            time.sleep(delay)

    def call(self, run_id: str, method: str, **kwargs: Any) -> Any:
        """``method(**kwargs)`` on run ``run_id``'s model; waits for a long method's future.

        The server holds the request up to ``LONG_POLL_SECONDS`` for a long method to finish and then answers its
        result, so a call that is done by then takes one request instead of two (the future's long-poll).
        """
        body = {"method": method, "kwargs": kwargs, "idempotency_key": uuid.uuid4().hex}
        params, timeout = {"wait": LONG_POLL_SECONDS}, self.timeout + LONG_POLL_SECONDS
        reply = self.request("POST", f"/runs/{run_id}/call", body, params=params, retry_safe=True, timeout=timeout)
        return self.resolve(reply)

    def resolve(self, reply: Any) -> Any:
        """The result of a reply that is ``{"result": ...}`` or ``{"future_id": ...}`` (then waited for)."""
        if isinstance(reply, dict) and "future_id" in reply:
            return self.wait(reply["future_id"])
        if isinstance(reply, dict) and "result" in reply:
            return reply["result"]
        raise ServerError(f"expected a result or a future_id from the server, got {reply!r:.300}")

    def wait(self, future_id: str) -> Any:
        """Long-poll a future until it is done; a failed one raises the error the server recorded."""
        while True:
            started = time.monotonic()
            state = self.request(
                "GET",
                f"/futures/{future_id}",
                params={"wait": LONG_POLL_SECONDS},
                timeout=self.timeout + LONG_POLL_SECONDS,
            )
            status = state.get("status") if isinstance(state, dict) else None
            if status == "done":
                return state.get("result")
            if status == "failed":
                raise error_from_body(state.get("error"), None)
            if status != "pending":
                raise ServerError(f"future {future_id}: unexpected state {state!r:.300}")
            time.sleep(max(0.0, MIN_POLL_INTERVAL - (time.monotonic() - started)))

    def _backoff(self, attempt: int) -> float:
        return min(self.retry_backoff * 2**attempt, 10.0)

    # ------------------------------------------------------------------ server resources

    def server_info(self) -> dict[str, Any]:
        """``{"base_model", "max_rank", "max_loras", "version"}`` (fetched once)."""
        if self._server_info is None:
            self._server_info = self.request("GET", "/server_info")
        return self._server_info

    def create_run(
        self,
        lora_config: dict[str, Any] | None,
        gradient_accumulation_steps: int = 1,
        base_model: str | None = None,
        seed: int | None = None,
    ) -> str:
        """A new run in this client's session; returns its id.

        With a ``lora_config`` the run is a LoRA adapter (in the server's shared pool); with ``None`` it
        trains all weights of its own copy of the model. ``base_model`` (a ``twinkle://`` full-model
        checkpoint) starts the run from that checkpoint instead of the server's base model.
        """
        body = {
            "session_id": self.session_id,
            "lora_config": lora_config,
            "gradient_accumulation_steps": gradient_accumulation_steps,
        }
        if base_model is not None:
            body["base_model"] = base_model
        if seed is not None:
            body["seed"] = seed
        return self.request("POST", "/runs", body)["run_id"]

    def list_runs(self) -> list[dict[str, Any]]:
        return self.request("GET", "/runs")["runs"]

    def get_run(self, run_id: str) -> dict[str, Any]:
        return self.request("GET", f"/runs/{run_id}")

    def resume_run(self, run_id: str) -> None:
        """Make a run whose adapter left the pool resident again (then ``load`` a checkpoint into it)."""
        self.request("POST", f"/runs/{run_id}/resume", {"session_id": self.session_id})

    def list_checkpoints(self, run_id: str) -> list[dict[str, Any]]:
        """``[{"name", "path", "created_at", "expires_at"}, ...]`` of one run."""
        return self.request("GET", f"/runs/{run_id}/checkpoints")["checkpoints"]

    def delete_checkpoint(self, run_id: str, name: str) -> None:
        self.request("DELETE", f"/runs/{run_id}/checkpoints/{name}")

    def set_checkpoint_ttl(self, run_id: str, name: str, ttl_seconds: float | None) -> dict[str, Any]:
        """Expire a checkpoint ``ttl_seconds`` from now (None: never); returns its listing entry."""
        body = {"ttl_seconds": ttl_seconds}
        return self.request("PUT", f"/runs/{run_id}/checkpoints/{name}/ttl", body, retry_safe=True)

    # ------------------------------------------------------------------ session

    @property
    def session_id(self) -> str:
        """This client's server session (opened on first use)."""
        return self.open_session()

    def open_session(self) -> str:
        """Open the server session and start its heartbeat thread, unless already open; returns its id."""
        with self._lock:
            if self._session_id is None:
                self._session_id = self.request("POST", "/sessions", {})["session_id"]
                self._heartbeat = _Heartbeat(partial(self._beat, self._session_id), self.heartbeat_interval)
                self._heartbeat.start()
            return self._session_id

    def _beat(self, session_id: str) -> None:
        self.request("POST", f"/sessions/{session_id}/heartbeat", {}, max_retries=0)

    def close(self) -> None:
        """Stop the heartbeat, end the session and close the connections (safe to call twice)."""
        atexit.unregister(self.close)
        with self._lock:
            heartbeat, session_id = self._heartbeat, self._session_id
            self._heartbeat = self._session_id = None
        if heartbeat is not None:
            heartbeat.stop()
        if session_id is not None and not self._http.is_closed:
            try:
                self.request("DELETE", f"/sessions/{session_id}", max_retries=0)
            except TwinkleError as exc:  # the server may be gone or have expired it; it cleans up either way
                logger.warning("could not end session %s: %s", session_id, exc)
        self._http.close()

    def __enter__(self) -> TwinkleClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _Heartbeat(threading.Thread):
    """Calls ``beat`` every ``interval`` seconds until stopped; a failed beat is logged, not fatal."""

    def __init__(self, beat: Callable[[], None], interval: float) -> None:
        super().__init__(name="twinkle-heartbeat", daemon=True)
        self._beat = beat
        self._interval = interval
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(self._interval):
            try:
                self._beat()
            except Exception as exc:  # the next beat may succeed; the server expires the session if none does
                logger.warning("session heartbeat failed: %s", exc)

    def stop(self) -> None:
        self._stopped.set()
        if self is not threading.current_thread():
            self.join(timeout=5)


def _reply(response: httpx.Response) -> Any:
    """The decoded body of a success, or the typed error of a failure."""
    body = _decode(response)
    if response.status_code >= 400:
        raise error_from_response(response, body)
    if body is None:
        raise ServerError(
            f"{response.request.method} {response.request.url}: unreadable reply "
            f"({response.headers.get('content-type')!r}): {response.text[:200]!r}"
        )
    return body


def _decode(response: httpx.Response) -> Any:
    """Wire or JSON body; ``{}`` for an empty one, ``None`` for anything else (e.g. an HTML error page)."""
    content_type = response.headers.get("content-type", "").split(";")[0].strip()
    if not response.content:
        return {}
    if content_type == wire.CONTENT_TYPE:
        return wire.decode(response.content)
    try:
        return json.loads(response.content)
    except ValueError:
        return None


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return max(0.0, float(response.headers["retry-after"]))
    except (KeyError, ValueError):
        return None
