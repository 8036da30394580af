"""OpenAI clients for agents, cheap to make per sample: ``client(base_url)`` for a coroutine
agent, ``sync_client(base_url)`` for a plain one.

Making an ``openai.AsyncOpenAI`` builds a TLS context (its CA bundle read and parsed: some
20 ms here), on the rollout's event loop, where every sample's agent runs: an agent that makes
one per sample holds up every other for that long, thousands of times a rollout. These share
one client per event loop (the rollout of each split has its own) and per process, and give
each sample a copy for its base URL (``with_options``: the same HTTP connection pool).
"""

from __future__ import annotations

import asyncio
import threading
import weakref

_ASYNC: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its AsyncOpenAI
_SYNC: list = []
_LOCK = threading.Lock()


def client(base_url: str, **options):
    """An ``openai.AsyncOpenAI`` for ``base_url`` (a sample's), sharing this event loop's
    connection pool; ``options`` as ``with_options`` takes them (``timeout``, ``max_retries``)."""
    import openai

    loop = asyncio.get_running_loop()
    shared = _ASYNC.get(loop)
    if shared is None:
        shared = _ASYNC[loop] = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    return shared.with_options(base_url=base_url, **options)


def sync_client(base_url: str, **options):
    """An ``openai.OpenAI`` for ``base_url``, sharing the process's connection pool (thread-safe)."""
    import openai

    with _LOCK:
        if not _SYNC:
            _SYNC.append(openai.OpenAI(base_url=base_url, api_key="none", max_retries=0))
    return _SYNC[0].with_options(base_url=base_url, **options)
