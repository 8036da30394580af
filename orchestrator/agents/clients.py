"""OpenAI clients for agents, cheap to make per sample: ``client(base_url)`` for a coroutine
agent, ``sync_client(base_url)`` for a plain one.

Making an ``openai.AsyncOpenAI`` builds a TLS context (its CA bundle read and parsed: some
20 ms here), on the rollout's event loop, where every sample's agent runs: an agent that makes
one per sample holds up every other for that long, thousands of times a rollout. These share
clients per event loop (the rollout of each split has its own) and per process, and give each
sample a copy for its base URL (``with_options``: the same HTTP connection pool).

An agent of the rollout calls the rollout's own endpoint in-process: the openai client on an
ASGI transport to the endpoint's app, on the same event loop (the same routes and handlers, no
sockets, no HTTP parsing on either side). Any other base URL, or ``in_process=False``, goes
over HTTP, where a loop's agents are spread over :data:`SHARDS` clients by base URL: httpcore's
pool looks at every connection it holds on each request and response, so that one pool of the
1,024 connections of as many agents at once spends most of the loop's time there (13.7 ms a
call with 512 agents, measured); a pool of 64 does not. The endpoint is plain HTTP on
loopback: no certificates are loaded.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
import zlib

from orchestrator.agents import endpoint

SHARDS = 16
_ASYNC: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> {shard: its AsyncOpenAI}
_SYNC: list = []
_POOL = {"max_connections": None, "max_keepalive_connections": None}
"""The agents running at once bound the connections (agents/runner.py); openai's default pool
of 1,000 would keep the agents beyond it waiting, their time running."""
_TIMEOUT = None
"""None: the runner bounds an agent's own time (rl.env_timeout_s) and the endpoint its calls'
(the engine's request timeout); openai's 5 s to connect passes on a loop as busy as a
rollout's (1,024 agents starting at once, 2 cores), failing calls that would have been served."""
_LOCK = threading.Lock()


def client(base_url: str, *, in_process: bool = True, **options):
    """An ``openai.AsyncOpenAI`` for ``base_url`` (a sample's), sharing one of this event loop's
    connection pools, or, for the rollout's own endpoint (``in_process``), calling its app on
    this loop; ``options`` as ``with_options`` takes them (``timeout``, ``max_retries``)."""
    import openai

    shards = _ASYNC.setdefault(asyncio.get_running_loop(), {})
    app = endpoint.local_app(base_url) if in_process else None
    shard = ("in-process", id(app)) if app is not None else zlib.crc32(base_url.encode()) % SHARDS
    shared = shards.get(shard)
    if shared is None:
        if app is not None:  # the rollout's own endpoint: its app called on this loop, no sockets
            import httpx

            http = openai.DefaultAsyncHttpxClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False))
        else:
            limits = type(openai.DEFAULT_CONNECTION_LIMITS)(**_POOL)  # the Limits of the httpx openai is built on
            http = openai.DefaultAsyncHttpxClient(limits=limits, verify=False)
        shared = shards[shard] = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=_TIMEOUT,
                                                    http_client=http)
    return shared.with_options(base_url=base_url, **options)


def sync_client(base_url: str, **options):
    """An ``openai.OpenAI`` for ``base_url``, sharing the process's connection pool (thread-safe)."""
    import openai

    with _LOCK:
        if not _SYNC:
            _SYNC.append(openai.OpenAI(base_url=base_url, api_key="none", max_retries=0))
    return _SYNC[0].with_options(base_url=base_url, **options)
