"""The tool demo as an agent written against the OpenAI API: the model is offered the calculator
as a tool, its tool calls come back parsed (``rollout.tool_parser``, hermes by default), the
agent answers each with a ``tool`` message and asks again, until the model answers without a
call. The run records every token the model sampled through the rank's agent endpoint and
trains on them, as it does for the calculator environment (orchestrator.demo.calculator).

Run it on the tool demo's data (the folder's demo.json names the math reward, which grades the
text the agent returns; ``rl.agent`` stands for the calculator environment it also names):

    python3 -m orchestrator demo-data --tools --data-path /tmp/orch-tools
    PYTHONPATH=examples/agents python3 -m orchestrator run --data-path /tmp/orch-tools \\
        --log-path /tmp/orch-tools-agent --rl-phase both --eval-interval 3 --max-iterations 10 \\
        rl.max_tokens=64 rl.agent=calculator_agent:solve

Any OpenAI client works against ``base_url``; ``orchestrator.agents.clients.client`` is an
``openai.AsyncOpenAI`` that shares one connection pool per rollout (making a new one costs some
20 ms of the event loop every agent runs on).
"""

from __future__ import annotations

import re

from orchestrator.agents.clients import client
from orchestrator.demo.calculator import CALC_TOOL, answer

MAX_CALLS = 3
"""Model calls a sample may make, as rl.max_turns=3 allows the environment."""
BOXED_NUMBER = re.compile(r"\\boxed\{-?\d+\}")


async def solve(task: dict, base_url: str) -> str:
    """The model's final answer to ``task`` (rl.reward grades it), or "" when it gave none."""
    openai = client(base_url)
    messages = list(task["prompt"])
    for _ in range(MAX_CALLS):
        reply = (await openai.chat.completions.create(model="policy", messages=messages, tools=[CALC_TOOL])).choices[0].message
        if not reply.tool_calls:  # an answer, or text that is neither (a malformed call comes back as text)
            text = reply.content or ""
            return text if BOXED_NUMBER.search(text) else ""  # a boxed expression is no answer: the product is calc's to work out
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": answer(call.model_dump())})
    return ""
