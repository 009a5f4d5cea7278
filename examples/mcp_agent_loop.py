"""An agent loop that calls its MCP tools through idemproxy exactly once per tool call.

The orchestrator (this loop, never the model) puts the identity of every tool call in
`params._meta`: the operation (one user request), the model round, and the model
provider's own tool-call id. A retry of the same call (a dropped stream, a timeout, a
crash and restart of the loop) sends the same three values with whatever new JSON-RPC id
and session the client has, and idemproxy answers it from the stored result instead of
running the tool again.

Run it against the test fixture server behind the proxy:

    python3 -m venv .venv && .venv/bin/pip install -r fixtures/mcp/requirements.txt
    .venv/bin/python fixtures/mcp/server.py 9100 json &
    cargo run -- serve --config config/mcp.yaml &
    .venv/bin/python examples/mcp_agent_loop.py http://127.0.0.1:8080/tools/mcp

The "model" here is scripted; with a real provider, `tool_call.id` is the id of the
tool-use block (OpenAI `call_...`, Anthropic `toolu_...`).
"""

import asyncio
import sys
import uuid
from dataclasses import dataclass

from mcp import Client


@dataclass
class ToolCall:
    id: str  # the model provider's tool-call id
    name: str
    arguments: dict


def scripted_model(round_no: int) -> list[ToolCall]:
    """Stands in for the model: one round asking to send one email."""
    if round_no == 1:
        return [ToolCall("call_7f3a", "send_email", {"to": "ann@example.com", "subject": "Your order"})]
    return []


def identity(operation_id: str, round_no: int, call: ToolCall) -> dict:
    """The `_meta` fields idemproxy derives the key from (identity.derive_from_meta)."""
    return {
        "io.idemproxy/operation_id": operation_id,
        "io.idemproxy/model_round": str(round_no),
        "io.idemproxy/tool_call_id": call.id,
    }


async def run_tool(url: str, operation_id: str, round_no: int, call: ToolCall, tries: int = 3):
    """Call a tool; on a transport failure retry it as the same logical call."""
    for attempt in range(1, tries + 1):
        try:
            async with Client(url) as client:  # a fresh connection and session per try
                return await client.call_tool(call.name, call.arguments, meta=identity(operation_id, round_no, call))
        except Exception as e:  # noqa: BLE001 - a sketch: real loops tell errors apart
            print(f"  try {attempt} of {call.name} failed ({e!r}); retrying the same call")
    raise RuntimeError(f"{call.name} failed {tries} times")


async def main(url: str) -> None:
    operation_id = f"op_{uuid.uuid4().hex[:12]}"  # one per user request
    round_no = 1
    while calls := scripted_model(round_no):
        for call in calls:
            result = await run_tool(url, operation_id, round_no, call)
            print(f"round {round_no}: {call.name} -> {result.structured_content or result.content}")
            # The loop crashes here and restarts: the same call again is a replay, not a
            # second email.
            again = await run_tool(url, operation_id, round_no, call)
            assert again.model_dump() == result.model_dump()
            print(f"round {round_no}: {call.name} retried -> the same result, sent once")
        round_no += 1


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8080/tools/mcp"))
