#!/usr/bin/env python3
"""An agent's tool loop in front of idemproxy, for the OpenAI and the Anthropic tool-call
formats. Standard library only; runs offline against the bundled fake downstream.

The model is scripted (no network, no API key): each turn it answers as the provider's API
would, with tool calls carrying the provider's own ids (`call_...` for OpenAI,
`toolu_...` for Anthropic). The orchestrator (this loop, never the model) turns each tool
call into an HTTP call to the proxy with the three identity headers:

    X-Operation-Id   the conversation / operation (one per user request)
    X-Model-Round    which model turn asked for the call
    X-Tool-Call-Id   the provider's tool-call id

The loop "crashes" after the first send of every side-effecting call (it drops the answer
on the floor, as a process killed before the result reached the model would) and runs the
turn again. The retry carries the same three values, so the proxy replays the stored
answer: the user gets one email per tool call, however often the loop retries.

    cargo run --release --bin fake-downstream &                    # 127.0.0.1:9001
    IDEMPROXY_ADMIN_TOKEN=dev-token-0123456789 cargo run --release -- serve &
    python3 examples/agent_tool_loop.py --format openai
    python3 examples/agent_tool_loop.py --format anthropic

Exit status 0 when every tool call had exactly one side effect downstream.
"""

import argparse
import json
import sys
import urllib.error
import urllib.request
import uuid

# What the tools are, as the proxy's config/idemproxy.yaml routes them (mount /mail).
TOOLS = {
    "send_email": {"method": "POST", "path": "/mail/send"},
}


def scripted_model(fmt, round_no):
    """The model's reply for one round, in the provider's own wire format."""
    emails = [
        {"to": "ada@example.com", "subject": "Your invoice"},
        {"to": "grace@example.com", "subject": "Meeting notes"},
    ]
    if round_no > 1:  # after the tool results, the model answers in text
        if fmt == "openai":
            return {"choices": [{"message": {"role": "assistant", "content": "Both sent."}}]}
        return {"content": [{"type": "text", "text": "Both sent."}], "stop_reason": "end_turn"}
    if fmt == "openai":
        return {
            "choices": [
                {
                    "message": {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": f"call_{i}_{uuid.uuid4().hex[:8]}",
                                "type": "function",
                                "function": {"name": "send_email", "arguments": json.dumps(e)},
                            }
                            for i, e in enumerate(emails)
                        ],
                    }
                }
            ]
        }
    return {
        "content": [
            {"type": "tool_use", "id": f"toolu_{i}_{uuid.uuid4().hex[:8]}", "name": "send_email", "input": e}
            for i, e in enumerate(emails)
        ],
        "stop_reason": "tool_use",
    }


def tool_calls(fmt, reply):
    """(provider tool-call id, tool name, arguments) of a model reply."""
    if fmt == "openai":
        msg = reply["choices"][0]["message"]
        return [
            (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in msg.get("tool_calls") or []
        ]
    return [(b["id"], b["name"], b["input"]) for b in reply["content"] if b["type"] == "tool_use"]


def call_tool(proxy, operation_id, round_no, call_id, name, args):
    """One tool call through the proxy; identity from the orchestrator, never the model."""
    tool = TOOLS[name]
    req = urllib.request.Request(
        proxy + tool["path"],
        data=json.dumps(args).encode(),
        method=tool["method"],
        headers={
            "content-type": "application/json",
            "x-operation-id": operation_id,
            "x-model-round": f"round_{round_no}",
            "x-tool-call-id": call_id,
        },
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"null")


def downstream_commits(downstream):
    with urllib.request.urlopen(downstream + "/_stats", timeout=5) as resp:
        return json.loads(resp.read())["commits"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", choices=["openai", "anthropic"], required=True)
    ap.add_argument("--proxy", default="http://127.0.0.1:8080")
    ap.add_argument("--downstream", default="http://127.0.0.1:9001")
    opts = ap.parse_args()

    before = downstream_commits(opts.downstream)
    operation_id = f"op_{uuid.uuid4().hex[:12]}"  # one per user request
    round_no = 1
    reply = scripted_model(opts.format, round_no)
    calls = tool_calls(opts.format, reply)
    for call_id, name, args in calls:
        # First attempt: sent, then the loop "crashes" before the result reaches the model.
        first = call_tool(opts.proxy, operation_id, round_no, call_id, name, args)
        # The workflow engine runs the step again: same operation, round and call id.
        retry = call_tool(opts.proxy, operation_id, round_no, call_id, name, args)
        status, headers, body = retry
        lower = {k.lower(): v for k, v in headers.items()}
        print(
            f"[{opts.format}] {call_id} {name}({args['to']}): first {first[0]}, "
            f"retry {status} replayed={lower.get('idempotent-replayed', 'false')} "
            f"execution={lower.get('idempotency-execution-id')}"
        )
        if first[0] >= 300 or status != first[0] or body != first[2]:
            print(f"unexpected answers: {first} / {retry}", file=sys.stderr)
            return 1
        if lower.get("idempotent-replayed") != "true":
            print("the retry was not a replay", file=sys.stderr)
            return 1
    round_no += 1
    final = scripted_model(opts.format, round_no)
    sent = downstream_commits(opts.downstream) - before
    print(f"[{opts.format}] model: {json.dumps(final)[:60]}... ; emails sent: {sent} for {len(calls)} tool calls")
    if sent != len(calls):
        print(f"expected {len(calls)} side effects downstream, saw {sent}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
