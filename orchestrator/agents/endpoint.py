"""The agent endpoint: an OpenAI-compatible HTTP API in front of a rank's engines, for agents
written against it (``rl.agent``). Each sample gets a base URL of its own,
``http://127.0.0.1:PORT/sessions/<id>/v1``, so that every call is attributed to its sample:

    POST /sessions/<id>/v1/chat/completions   messages, tools -> the model's reply (tool calls parsed)
    POST /sessions/<id>/v1/completions        a prompt (text or token ids) -> its continuation
    GET  /sessions/<id>/v1/models             the one model, ``policy``

The server (starlette under uvicorn) runs on the rollout's event loop, and each call is one
request through the rollout's in-flight budget (:class:`Inflight`), as an environment's turn
is. A call's prompt is token ids (``sessions.py``): the sampled ids are never tokenized again.
Sampling is the run's (``rl.temperature``, ``rl.top_p``; eval's for eval): a request's own
``temperature`` and the like are ignored, since the update assumes the run's policy; its
``max_tokens`` (or ``max_completion_tokens``) may only lower the room ``rl.max_tokens`` and
the model's context leave. A sample has no room left: the reply is empty, ``finish_reason``
``length``. The time a call takes is the endpoint's, not the agent's (``Session.busy_s``):
``rl.env_timeout_s`` bounds the agent's own time only.

A call with ``stream`` is answered as server-sent events: the whole reply in one chunk (its
``delta`` the message, tool calls included), a usage chunk when ``stream_options.include_usage``
asks for one, then ``data: [DONE]``; the model's turn is sampled whole either way.

Refused, with the OpenAI API's error shape: an unknown session (404), a call for a sample
whose agent already returned (409), ``n`` > 1, and another model's name (400/404).
An engine that fails answers 502, and the failure is kept for the rollout to raise when the
agent returns (an engine's death is the rank's, not the agent's).

With ``rollout.partial``, the rollout's stop (:attr:`AgentEndpoint.stopping`) ends each sample
at its call: a reply being sampled keeps what it had (finish reason ``abort``), a call made
after the stop began is recorded (its messages) and not sampled, and the call is refused (409,
``rollout_stopped``), its sample carried; the next rollout runs the agent again and answers its
calls from the record (``replay.py``). Without the rollout's own stop, a reply another rank's
stop of a shared engine cut goes on at once.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import socket
import time
import uuid

from orchestrator.agents import replay
from orchestrator.agents.sessions import Session
from orchestrator.data.carry import ABORTED
from orchestrator.engine.client import Completion
from orchestrator.workloads.rl.engine_requests import Inflight, Request, Stopped
from orchestrator.workloads.rl.episodes import request_seed

log = logging.getLogger(__name__)

_ENDED_KEPT = 100_000
"""Ended sessions remembered, so that a late call is told it is late (409) rather than unknown."""

MODEL = "policy"
"""The model name agents call: the policy the rollout serves, whichever checkpoint it is."""

_SERVING: dict[int, "AgentEndpoint"] = {}
"""This process's endpoints by port, for :func:`local_app`."""


class CallRefused(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


class AgentEndpoint:
    """The endpoint of one rank's rollout: its sessions, and the server on the rollout's loop."""

    def __init__(self, tokenizer, *, tool_parser: str, max_tokens: int, context: int | None):
        self.tokenizer, self.tool_parser, self.max_tokens, self.context = tokenizer, tool_parser, max_tokens, context
        self.sessions: dict[str, Session] = {}
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()  # recent sessions' ids, for a 409
        self.inflight: Inflight | None = None
        self.port: int | None = None
        self._server = None
        self._serving: asyncio.Task | None = None
        self._ready: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.engine_failure: BaseException | None = None
        self.stopping = False
        """The rollout stops (rollout.partial): what is sampled is cut, what is not is not begun."""
        # Imported here, on the rollout's own thread, not on its event loop: importing blocks,
        # and the agents' clocks run on the loop. So is openai, which most agents call with
        # (0.8 s of the loop when the first agent's client imported it), and its resources,
        # which it imports on a client's first call (0.3 s more).
        import uvicorn

        try:
            import openai.resources  # noqa: F401
        except ImportError:
            pass

        self._app = self.app()
        self._config = uvicorn.Config(self._app, log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=30)
        self._config.load()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, inflight: Inflight) -> None:
        """Serve on 127.0.0.1 (a free port), on the running loop; once. Every caller returns
        when the server listens (no agent starts before its endpoint serves)."""
        self.inflight = inflight
        if self._ready is None:
            self._ready = asyncio.get_running_loop().create_future()
            try:
                await self._serve()
            except BaseException as e:
                self._ready.set_exception(e)
                raise
            self._ready.set_result(None)
        await asyncio.shield(self._ready)

    async def _serve(self) -> None:
        import uvicorn

        _raise_open_files_limit()

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(self._config)
        self._server.install_signal_handlers = lambda: None  # the rank owns its signals (uvicorn < 0.29 asks)
        self._serving = asyncio.ensure_future(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._serving.done():
                self._serving.result()  # raises what stopped it
            await asyncio.sleep(0.01)
        self._loop = asyncio.get_running_loop()
        _SERVING[self.port] = self
        log.info("agent endpoint serving on http://127.0.0.1:%d/sessions/<sample>/v1", self.port)

    async def stop(self) -> None:
        _SERVING.pop(self.port, None)
        if self._server is not None:
            self._server.should_exit = True
            await asyncio.wait({self._serving}, timeout=10)
        self._server = self._serving = self._ready = None

    # -- sessions ----------------------------------------------------------------------------

    def open(self, task: dict, seed: str, *, key: str = "", script: list[replay.Recorded] = ()) -> tuple[Session, str]:
        """A new sample's session and its base URL, on the running loop; ``key`` names the sample
        across rollouts, ``script`` is a carried sample's calls (``replay.py``)."""
        session = Session(uuid.uuid4().hex, task, seed, key=key, tool_parser=self.tool_parser, script=list(script),
                          halted=asyncio.get_running_loop().create_future())
        self.sessions[session.id] = session
        return session, f"http://127.0.0.1:{self.port}/sessions/{session.id}/v1"

    def close(self, session: Session) -> None:
        """The sample's agent returned: later calls are refused (409), then forgotten."""
        session.closed = True

    def forget(self, session: Session) -> None:
        """Drop the sample's calls (its record has them); a late call still gets a 409."""
        self.sessions.pop(session.id, None)
        self._ended[session.id] = None
        while len(self._ended) > _ENDED_KEPT:
            self._ended.popitem(last=False)

    # -- the API -----------------------------------------------------------------------------

    def app(self):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        async def models(request):
            try:
                self._session(request.path_params["session"])
            except CallRefused as e:
                return _error(e)
            return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "orchestrator"}]})

        def call(method):
            async def handle(request):
                try:
                    session = self._session(request.path_params["session"])
                    try:
                        body = await request.json()
                    except ValueError:
                        raise CallRefused(400, "the request body is not JSON") from None
                    reply = await method(session, body)
                    return _events(reply, body) if body.get("stream") else JSONResponse(reply)
                except CallRefused as e:
                    return _error(e)
            return handle

        return Starlette(routes=[Route("/sessions/{session}/v1/models", models, methods=["GET"]),
                                 Route("/sessions/{session}/v1/chat/completions", call(self.chat), methods=["POST"]),
                                 Route("/sessions/{session}/v1/completions", call(self.complete), methods=["POST"])])

    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None and session_id in self._ended:
            raise CallRefused(409, f"session {session_id} is over: its agent already returned (or ran out of time)")
        if session is None:
            raise CallRefused(404, f"no session {session_id!r} on this endpoint: each sample calls the base URL it was given")
        if session.stopped:
            raise CallRefused(409, f"session {session_id} was stopped by the rollout's stop (rollout.partial)", "rollout_stopped")
        if session.closed:
            raise CallRefused(409, f"session {session_id} is over: its agent already returned (or ran out of time)")
        return session

    @staticmethod
    def _check(body: object) -> None:
        if not isinstance(body, dict):
            raise CallRefused(400, "the request body must be a JSON object")
        if (body.get("n") or 1) != 1:
            raise CallRefused(400, "n must be 1: each sample is one conversation")
        if body.get("model", MODEL) != MODEL:
            raise CallRefused(404, f"the model is {MODEL!r}, not {body.get('model')!r}", "model_not_found")

    async def complete(self, session: Session, body: object) -> dict:
        """``/v1/completions``: a prompt's continuation, recorded as the sample's turn."""
        self._check(body)
        try:
            prompt = session.text_prompt(self.tokenizer, body.get("prompt"))
        except ValueError as e:
            raise CallRefused(400, str(e)) from None
        created = int(time.time())
        completion = await self._sample(session, prompt, body)
        if completion is None:
            text, finish, sampled = "", "length", 0
        else:
            session.answered_text(completion)
            if completion.finish_reason == ABORTED:
                self._stopped(session)
            text, finish, sampled = completion.text, completion.finish_reason, len(completion.token_ids)
        return {"id": f"cmpl-{session.id[:12]}-{session.calls}", "object": "text_completion", "created": created, "model": MODEL,
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": sampled, "total_tokens": len(prompt) + sampled}}

    async def _sample(self, session: Session, prompt: list[int], body: dict) -> Completion | None:
        """The model's reply to the call, within its room (None: no room): from the record for a
        carried sample's call made before its stop (``replay.py``), else the engine's completion
        of ``prompt``. A reply the engines were stopped in goes on from its ids, unless the stop
        is this rollout's (:attr:`stopping`): then it comes back as it stands (finish reason
        ``abort``), and a call not sampled yet is refused, its sample stopped."""
        reply = None
        if session.calls <= len(session.script):
            recorded = session.script[session.calls - 1]
            if prompt != recorded.context:
                error = (f"call {session.calls} of a sample carried by rollout.partial is not the call it made before its "
                         f"rollout stopped: a carried agent is run again and given its replies again, which needs an agent "
                         f"that makes the same calls given the same replies (docs/environments.md)")
                session.halt(error)
                raise CallRefused(409, error)
            if recorded.reply is not None and recorded.reply.finish_reason != ABORTED:
                return recorded.reply
            reply = recorded.reply
        room = self._room(session, prompt)
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        if isinstance(asked, int) and asked > 0:
            room = min(room, asked)
        while reply is None or reply.finish_reason == ABORTED:
            have = len(reply.token_ids) if reply is not None else 0
            if room - have <= 0:
                return None if reply is None else dataclasses.replace(reply, finish_reason="length")
            if self.stopping:
                return reply if reply is not None else self._stopped(session)
            name = f"{session.seed}:{session.calls}" + (f":{have}" if have else "")
            request = Request([str(session.task["id"])], [prompt + (reply.token_ids if reply else [])], request_seed(name), n=1,
                              max_tokens=room - have)
            session.call_began = time.monotonic()
            try:
                more = (await self.inflight.complete(request)).groups[0][0]
            except Stopped:  # the rollout stopped before the request reached an engine
                return reply if reply is not None else self._stopped(session)
            except Exception as e:  # noqa: BLE001 - the engine's failure: the rollout's to raise
                self.engine_failure = self.engine_failure or e
                raise CallRefused(502, f"the engine failed: {e}", "server_error") from None
            finally:
                session.in_calls_s += time.monotonic() - session.call_began
                session.call_began = None
            reply = replay.joined(reply, more)
        return reply

    @staticmethod
    def _stopped(session: Session):
        """Refuse the call of a sample the rollout's stop ended (its agent is cancelled, or told
        so): it is carried, and goes on in the next rollout."""
        session.halt()
        raise CallRefused(409, "the rollout stopped (rollout.partial): this sample goes on in the next rollout, "
                               "its agent run again", "rollout_stopped")

    async def chat(self, session: Session, body: object) -> dict:
        self._check(body)
        tools = body.get("tools") or None
        try:
            prompt = session.prompt(self.tokenizer, body.get("messages"), tools)
        except ValueError as e:
            raise CallRefused(400, str(e)) from None
        except Exception as e:  # noqa: BLE001 - a message the chat template cannot render
            raise CallRefused(400, f"the chat template cannot render these messages: {e!r}") from None
        created = int(time.time())
        completion = await self._sample(session, prompt, body)
        if completion is None:
            return _response(session, {"role": "assistant", "content": ""}, "length", created, prompt, 0)
        message, finish = session.answered(completion)
        if completion.finish_reason == ABORTED:
            self._stopped(session)
        return _response(session, message, finish, created, prompt, len(completion.token_ids),
                         completion.token_logprobs if body.get("logprobs") else None, completion)

    def _room(self, session: Session, prompt: list[int]) -> int:
        """What rl.max_tokens (all of a segment's ids after its prompt) and the context leave."""
        c = session.conversation
        room = self.max_tokens - len(c.token_ids)
        return room if self.context is None else min(room, self.context - len(prompt))


def local_app(base_url: str):
    """The ASGI app of the endpoint that serves ``base_url`` from this process on the running
    event loop (an agent of its rollout), else None: agents/clients.py calls it in-process."""
    from urllib.parse import urlsplit

    url = urlsplit(base_url)
    endpoint = _SERVING.get(url.port) if url.hostname == "127.0.0.1" else None
    if endpoint is None or endpoint._loop is not asyncio.get_running_loop():
        return None
    return endpoint._app


def _response(session: Session, message: dict, finish: str, created: int, prompt: list[int], sampled: int,
              logprobs: list[float] | None = None, completion=None) -> dict:
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    if logprobs is not None and completion is not None:
        tokens = completion.tokens or [""] * len(logprobs)
        choice["logprobs"] = {"content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                                          for t, lp in zip(tokens, logprobs)]}
    return {"id": f"chatcmpl-{session.id[:12]}-{session.calls}", "object": "chat.completion", "created": created, "model": MODEL,
            "choices": [choice], "usage": {"prompt_tokens": len(prompt), "completion_tokens": sampled,
                                           "total_tokens": len(prompt) + sampled}}


def _events(reply: dict, body: dict):
    """``reply`` (a chat completion or a completion) as a stream: one chunk holding all of it,
    the usage when asked for, then ``[DONE]``."""
    from starlette.responses import Response

    chunk = {k: v for k, v in reply.items() if k != "usage"}
    if reply["object"] == "chat.completion":
        chunk["object"] = "chat.completion.chunk"
        chunk["choices"] = [{"index": c["index"], "delta": _delta(c["message"]), "finish_reason": c["finish_reason"],
                             "logprobs": c["logprobs"]} for c in reply["choices"]]
    events = [chunk]
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append({**{k: chunk[k] for k in ("id", "object", "created", "model")}, "choices": [], "usage": reply["usage"]})
    text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return Response(text, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _delta(message: dict) -> dict:
    delta = dict(message)
    if "tool_calls" in delta:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
    return delta


def _raise_open_files_limit() -> None:
    """The soft limit on open files raised to the hard one, as vLLM's server raises it: every
    agent running holds two sockets here (its client's and the endpoint's), up to the in-flight
    budget's 1,024 an engine, where a soft limit is often 1,024."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # not allowed here: the soft limit stands
            pass


def _error(e: CallRefused):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": str(e), "type": e.kind, "code": e.status}}, status_code=e.status)
