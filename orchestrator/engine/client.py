"""The rollout's client for an inference engine: the embedded one or a real vLLM server,
which speak the same OpenAI-compatible HTTP API.

``base_url`` is the server's root (``http://host:port``), not its ``/v1``: ``/health`` lives
at the root on both servers. :meth:`EngineClient.complete` sends one request and waits for
it (httpx); :meth:`EngineClient.acomplete` sends one on an ``aiohttp.ClientSession`` of the
caller's event loop (:meth:`EngineClient.async_http`), so that many requests can be in flight
at once (``workloads/rl/engine_requests.py``). The rollout's requests go through aiohttp, not
httpx's async client: a request costs the event loop a fifth to a third of the CPU there
(0.18 to 0.27 ms against 0.70 to 0.91 ms, 16 to 800 in flight), and the loop that sends them
also runs a multi-turn rollout's samples and a rank's agents, one request a turn or a call
(docs/performance.md, section 22).
:meth:`EngineClient.aprompt_logprobs` asks a model to score token ids it is given rather than
sample (a teacher's log-probs of a student's tokens), with vLLM's ``prompt_logprobs``.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Callable, Sequence

import aiohttp
import httpx

from orchestrator.errors import ServiceError
from orchestrator.protocol.waiting import Backoff, Deadline, poll

_HEALTH_BACKOFF = Backoff(min_s=0.05, max_s=1.0)
_HEALTH_PROBE_TIMEOUT_S = 5.0
_MESSAGE_LIMIT = 2000


class EngineError(ServiceError):
    """The engine could not serve a request."""


class EngineUnavailable(EngineError):
    """Nothing answered at the engine's URL, or not in time."""


class EngineHTTPError(EngineError):
    """The engine answered with an HTTP error; ``status`` and ``server_message`` say which."""

    def __init__(self, url: str, status: int, server_message: str):
        super().__init__(f"{url} answered HTTP {status}: {server_message}")
        self.url = url
        self.status = status
        self.server_message = server_message


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    finish_reason: str
    """"stop" (EOS or a stop string) or "length" (max_tokens)."""
    token_logprobs: list[float] | None
    """Logprob of each generated token under the raw model distribution; None unless asked."""
    tokens: list[str] | None
    """Each generated token as a string (EOS included); None unless logprobs were asked."""
    token_ids: list[int] | None = None
    """Generated token ids (EOS included); only with ``return_token_ids``."""
    prompt_token_ids: list[int] | None = None
    """The prompt as the engine tokenized it; only with ``return_token_ids``."""
    stop_reason: str | int | None = None
    """What ended a "stop": the stop string (cut from ``text``), or the stop token's id (vLLM);
    None for EOS or "length"."""

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the completion; None when none did."""
        return self.stop_reason if isinstance(self.stop_reason, str) else None


def _server_message(raw: bytes) -> str:
    """The message out of an error body: OpenAI/vLLM ``{"error": {...}}``, older vLLM's flat
    ``{"message": ...}``, FastAPI's ``{"detail": ...}``, or the raw text."""
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        body = json.loads(text)
    except ValueError:
        return text[:_MESSAGE_LIMIT] or "(empty body)"
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if key in body:
                return str(body[key])
    return text[:_MESSAGE_LIMIT]


_CLOSED_UNDER_IT = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
"""The connection ended with no response: closed by the server or reset (not refused: that is
:class:`aiohttp.ClientConnectorError`, not tried again), not timed out."""


class EngineClient:
    def __init__(self, base_url: str, timeout_s: float, *, model: str | None = None):
        """``timeout_s`` bounds each HTTP call (a completion included); ``model`` is the name
        sent in requests, by default the first one ``/v1/models`` lists."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._model = model
        self._http = httpx.Client(timeout=timeout_s, verify=self._verify)  # pooled and thread-safe; its sockets close with it

    @property
    def _verify(self) -> bool:
        # Plain http has no certificates to check, and loading the CA bundle costs tens of
        # milliseconds a client: a rank's rollout makes several.
        return not self.base_url.startswith("http://")

    def async_http(self, timeout_s: float | None = None, *, keepalive_s: float = 15.0) -> aiohttp.ClientSession:
        """A session of the running event loop for :meth:`acomplete` and :meth:`aprompt_logprobs`:
        one pool of connections, as many as requests in flight (the caller bounds those), an
        idle one closed after ``keepalive_s``; ``timeout_s`` bounds a request (default the
        client's). The caller closes it."""
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=keepalive_s, ssl=None if self._verify else False)
        return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s or self.timeout_s))

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, body: dict | None = None, *, timeout_s: float | None = None) -> bytes:
        url = self.base_url + path
        try:
            response = self._http.request(method, url, json=body, timeout=timeout_s or self.timeout_s)
        except httpx.HTTPError as e:  # refused, reset, timed out
            raise EngineUnavailable(f"cannot reach the engine at {method} {url}: {e!r}") from e
        return self._checked(method, url, response.status_code, response.content)

    @staticmethod
    def _checked(method: str, url: str, status: int, raw: bytes) -> bytes:
        """``raw``, the body of an answer with HTTP ``status``; EngineHTTPError for a refusal."""
        if status >= 400:
            raise EngineHTTPError(f"{method} {url}", status, _server_message(raw))
        return raw

    def _json(self, method: str, path: str, body: dict | None = None) -> dict:
        raw = self._request(method, path, body)
        try:
            return json.loads(raw)
        except ValueError as e:
            raise EngineError(f"{method} {self.base_url}{path} answered with invalid JSON: {raw[:200]!r}") from e

    def health(self) -> bool:
        """True when ``/health`` answers 200."""
        return self._probe_health() is None

    def _probe_health(self) -> str | None:
        """None when healthy, else what was seen instead."""
        try:
            self._request("GET", "/health", timeout_s=min(self.timeout_s, _HEALTH_PROBE_TIMEOUT_S))
        except EngineError as e:
            return str(e)
        return None

    def wait_healthy(self, deadline_s: float, should_stop: Callable[[], bool] | None = None) -> None:
        """Poll ``/health`` with backoff until it answers 200.

        Raises EngineUnavailable when ``deadline_s`` seconds pass first, or at once when
        ``should_stop()`` turns true (the engine process died, the rank is stopping); the
        error names the URL and what the last probe saw.
        """
        deadline = Deadline.after(deadline_s, f"{self.base_url}/health")
        last_seen = "nothing yet"

        def probe() -> bool | None:
            nonlocal last_seen
            if should_stop is not None and should_stop():
                raise EngineUnavailable(f"stopped waiting for {deadline.what} to answer 200; last seen: {last_seen}")
            seen = self._probe_health()
            if seen is None:
                return True
            last_seen = seen
            return None

        poll(probe, deadline=deadline, backoff=_HEALTH_BACKOFF,
             on_timeout=lambda: EngineUnavailable(f"{deadline.what} did not answer 200 within {deadline_s:g}s; last seen: {last_seen}"))

    def models(self) -> list[str]:
        """The names the engine serves."""
        body = self._json("GET", "/v1/models")
        try:
            return [card["id"] for card in body["data"]]
        except (KeyError, TypeError) as e:
            raise EngineError(f"{self.base_url}/v1/models answered an unexpected shape: {str(body)[:200]}") from e

    def reload(self, directory: str, served_model_name: str) -> float:
        """Embedded engine: serve ``directory`` in place under a new name, which this client
        uses from now on; returns the server's seconds. Raises EngineHTTPError when refused."""
        body = self._json("POST", "/reload", {"model": directory, "served_model_name": served_model_name})
        self._model = served_model_name
        return float(body.get("seconds", 0.0))

    def pause(self, *, wait_for_inflight_requests: bool = False) -> None:
        """``POST /pause`` (the embedded engine's and vLLM's): every request not answered yet
        comes back with what it sampled, finish reason ``abort`` (or, waiting, the running
        ones finish); later requests wait for :meth:`resume`."""
        self._json("POST", f"/pause?wait_for_inflight_requests={str(wait_for_inflight_requests).lower()}")

    def resume(self) -> None:
        self._json("POST", "/resume")

    def is_paused(self) -> bool:
        return bool(self._json("GET", "/is_paused").get("is_paused"))

    def use(self, name: str) -> None:
        """Send ``name`` as the model from now on (the engine serves the new policy under it)."""
        self._model = name

    def model(self) -> str:
        if self._model is None:
            names = self.models()
            if not names:
                raise EngineError(f"{self.base_url}/v1/models lists no model")
            self._model = names[0]
        return self._model

    def complete(
        self,
        prompts: Sequence[str] | Sequence[list[int]],
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int = 16,
        stop: Sequence[str] | None = None,
        seed: int | None = None,
        logprobs: int | None = None,
        return_token_ids: bool = False,
    ) -> list[list[Completion]]:
        """``n`` completions of each prompt (a text, or token ids the engine continues as they
        are): ``result[j][i]`` is sample ``i`` of prompt ``j``.

        Raises EngineHTTPError when the engine refuses the request, EngineUnavailable when it
        cannot be reached, and EngineError when its answer does not have the expected shape.
        """
        prompts = list(prompts)
        if not prompts:
            return []
        body = self._completion_body(prompts, n, temperature, top_p, max_tokens, stop, seed, logprobs, return_token_ids)
        return self._completions(self._json("POST", "/v1/completions", body), len(prompts), n, return_token_ids)

    async def acomplete(self, http: aiohttp.ClientSession, prompts: Sequence[str] | Sequence[list[int]], *, n: int = 1, temperature: float = 1.0,
                        top_p: float = 1.0, max_tokens: int = 16, stop: Sequence[str] | None = None, seed: int | None = None,
                        logprobs: int | None = None, return_token_ids: bool = False) -> list[list[Completion]]:
        """:meth:`complete` on ``http``, a session of the caller's event loop (its pool
        and timeouts are the caller's, :meth:`async_http`); the same errors. The served name must be known
        (``model=`` or an earlier :meth:`model`): this sends nothing else."""
        prompts = list(prompts)
        if not prompts:
            return []
        body = self._completion_body(prompts, n, temperature, top_p, max_tokens, stop, seed, logprobs, return_token_ids)
        return self._completions(await self._apost_completions(http, body), len(prompts), n, return_token_ids)

    async def aprompt_logprobs(self, http: aiohttp.ClientSession, prompts: Sequence[list[int]], *,
                               start: int | Sequence[int] = 1) -> list[list[float]]:
        """For each token-id prompt, the model's log-prob of each of its tokens from position
        ``start`` on (``start[j]`` for prompt ``j``; 1 at the least, as the first token has
        nothing before it), given the tokens before it, under the raw model distribution:
        ``result[j][i]`` is that of ``prompts[j][start_j + i]``. One request on ``http`` as
        :meth:`acomplete` sends it (the served name must be known), with vLLM's
        ``prompt_logprobs`` 0 and ``max_tokens`` 1: vLLM refuses 0 without ``echo``, and the
        one token sampled costs one row of a decoding step.

        Raises ValueError for a ``start`` out of its prompt's range, and as :meth:`acomplete`
        does otherwise: EngineHTTPError (a refused request: an id past the vocabulary, a
        prompt with no room for one more token), EngineUnavailable, and EngineError when the
        answer lacks the prompt's log-probs (an engine without ``prompt_logprobs``, or a pause
        that aborted the request before its prefill)."""
        prompts = [list(p) for p in prompts]
        starts = [start] * len(prompts) if isinstance(start, int) else list(start)
        if len(starts) != len(prompts):
            raise ValueError(f"{len(starts)} starts for {len(prompts)} prompts")
        for j, (ids, at) in enumerate(zip(prompts, starts)):
            if not 1 <= at <= len(ids):
                raise ValueError(f"start {at} of prompt {j} is out of 1..{len(ids)} (its length): the first token has no log-prob")
        if not prompts:
            return []
        body = {"model": self.model(), "prompt": prompts, "n": 1, "temperature": 0.0, "max_tokens": 1, "prompt_logprobs": 0}
        return self._prompt_logprobs(await self._apost_completions(http, body), prompts, starts)

    def _prompt_logprobs(self, response: dict, prompts: list[list[int]], starts: list[int]) -> list[list[float]]:
        """Each prompt's own tokens' log-probs from its start on, out of a /v1/completions answer
        with vLLM's ``prompt_logprobs``: per choice, None for the first token, then per position
        a dict from token id (as a string) to ``{"logprob", "rank", "decoded_token"}``."""
        url = f"{self.base_url}/v1/completions"
        try:
            choices = sorted(response["choices"], key=lambda c: c["index"])
            scored = [c.get("prompt_logprobs") for c in choices]
        except (KeyError, TypeError) as e:
            raise EngineError(f"{url} answered an unexpected shape: {e!r}") from e
        if len(choices) != len(prompts):
            raise EngineError(f"{url} answered {len(choices)} choices for {len(prompts)} prompts")
        result = []
        for j, (ids, at, positions, choice) in enumerate(zip(prompts, starts, scored, choices)):
            if not isinstance(positions, list) or len(positions) != len(ids):
                raise EngineError(
                    f"{url} answered prompt {j} ({len(ids)} tokens) with prompt_logprobs {str(positions)[:200]} "
                    f"(finish_reason {choice.get('finish_reason')!r}): expected one entry per prompt token"
                )
            try:
                result.append([float(positions[i][str(ids[i])]["logprob"]) for i in range(at, len(ids))])
            except (KeyError, TypeError, ValueError) as e:
                raise EngineError(f"{url} answered prompt {j} without its own token's log-prob at a position: {e!r}") from e
        return result

    async def _apost_completions(self, http: aiohttp.ClientSession, body: dict) -> dict:
        """POST ``body`` to /v1/completions on ``http``; the JSON answer."""
        url = f"{self.base_url}/v1/completions"
        for attempt in (1, 2):
            try:
                async with http.post(url, json=body) as response:
                    status, raw = response.status, await response.read()
                break
            except aiohttp.ClientConnectorError as e:  # refused: no engine there (a subclass of ClientOSError)
                raise EngineUnavailable(f"cannot reach the engine at POST {url}: {_why(e)}") from e
            except _CLOSED_UNDER_IT as e:
                if attempt == 2:
                    raise EngineUnavailable(f"cannot reach the engine at POST {url}: {_why(e)} (twice)") from e
                # A kept-alive connection the server closed as the request went out (uvicorn
                # drops idle ones after 5 s): no answer came, so sending it again is safe.
            except asyncio.TimeoutError as e:
                raise EngineUnavailable(f"POST {url} had no answer within {http.timeout.total} s") from e
            except aiohttp.ClientError as e:
                raise EngineUnavailable(f"cannot reach the engine at POST {url}: {_why(e)}") from e
        raw = self._checked("POST", url, status, raw)
        try:
            return json.loads(raw)
        except ValueError as e:
            raise EngineError(f"POST {url} answered with invalid JSON: {raw[:200]!r}") from e

    def _completion_body(self, prompts: list, n, temperature, top_p, max_tokens, stop, seed, logprobs,
                         return_token_ids: bool) -> dict:
        body: dict = {
            "model": self.model(),
            "prompt": prompts,
            "n": n,
            "temperature": temperature,
            "top_p": top_p,
            "max_tokens": max_tokens,
            "stop": list(stop) if stop else None,
            "seed": seed,
            "logprobs": logprobs,
        }
        if return_token_ids:
            body["return_token_ids"] = True  # only when asked: older vLLM ignores it with a warning
        return body

    def _completions(self, response: dict, count: int, n: int, return_token_ids: bool) -> list[list[Completion]]:
        """``n`` completions of each of ``count`` prompts out of a /v1/completions answer."""
        try:
            choices = sorted(response["choices"], key=lambda c: c["index"])
            completions = [self._completion(c, return_token_ids) for c in choices]
        except (KeyError, TypeError) as e:
            raise EngineError(f"{self.base_url}/v1/completions answered an unexpected shape: {e!r}") from e
        if [c["index"] for c in choices] != list(range(count * n)):
            raise EngineError(
                f"{self.base_url}/v1/completions answered choices {[c['index'] for c in choices]} "
                f"for {count} prompt(s) x n={n}"
            )
        # vLLM numbers choices prompt-major: index = prompt_index * n + sample_index.
        return [completions[j * n : (j + 1) * n] for j in range(count)]

    def _completion(self, choice: dict, return_token_ids: bool) -> Completion:
        logprobs = choice.get("logprobs")
        token_ids = prompt_token_ids = None
        if return_token_ids:
            token_ids, prompt_token_ids = choice.get("token_ids"), choice.get("prompt_token_ids")
            if not (_is_ids(token_ids) and _is_ids(prompt_token_ids)):
                raise EngineError(f"{self.base_url}/v1/completions was asked for token ids (return_token_ids) and answered "
                                  f"without them: vLLM >= 0.10.2 returns them")
        return Completion(
            text=choice["text"],
            finish_reason=choice["finish_reason"],
            token_logprobs=None if logprobs is None else logprobs["token_logprobs"],
            tokens=None if logprobs is None else logprobs["tokens"],
            token_ids=token_ids,
            prompt_token_ids=prompt_token_ids,
            stop_reason=choice.get("stop_reason"),
        )


def _why(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
