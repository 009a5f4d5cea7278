#!/usr/bin/env bash
# Runs the README's quick start as a new user would, from the repository root: the fake
# downstream, `serve` on the default config, one call, one replay, the agent examples
# (examples/agent_tool_loop.py, OpenAI and Anthropic formats), stop. CI runs it
# (.ci/run), so the first command a new user types keeps working. Every command below is
# checked to appear verbatim in README.md first.
#
#   scripts/quickstart.sh        # builds in release (as the README does), ~8 min cold
set -euo pipefail
cd "$(dirname "$0")/.."

SERVE='IDEMPROXY_ADMIN_TOKEN=dev-token-0123456789 cargo run --release -- serve'
DOWNSTREAM='cargo run --release --bin fake-downstream &'
CALL="curl -si localhost:8080/mail/send -H 'Idempotency-Key: k1' -H 'content-type: application/json' -d '{\"to\":\"a@example.com\"}'"

for cmd in "$SERVE" "$DOWNSTREAM" "$CALL"; do
  grep -qF -- "$cmd" README.md || { echo "[quickstart] README.md no longer says: $cmd" >&2; exit 1; }
done

for port in 8080 9001 9090; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    echo "[quickstart] port $port is in use; the quick start needs 8080, 9001 and 9090" >&2
    exit 1
  fi
done

# `serve` keeps its records in data/idemproxy.redb; leave a user's own file alone.
[ -e data/idemproxy.redb ] && { echo "[quickstart] data/idemproxy.redb exists; move it away first" >&2; exit 1; }

WORK=$(mktemp -d)
PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -f data/idemproxy.redb
  rmdir data 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

wait_port() {
  for _ in $(seq 1 1200); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.5; done
  echo "[quickstart] nothing listens on $1" >&2; return 1
}

echo "[quickstart] building (release, as the README's commands do)" >&2
cargo build --release --bins -q

# `cargo run` replaces itself with the program on Unix, so `$!` is the program's pid.
eval "${DOWNSTREAM%&} > $WORK/downstream.log 2>&1 &"
PIDS+=($!)
eval "${SERVE} 2> $WORK/serve.log &"
PIDS+=($!)
wait_port 9001
wait_port 8080

first=$(eval "$CALL")
second=$(eval "$CALL")
echo "$first" | head -1 | grep -q ' 201 ' || { echo "[quickstart] first call: $first" >&2; exit 1; }
echo "$second" | grep -qi '^idempotent-replayed: true' || { echo "[quickstart] second call was not a replay: $second" >&2; exit 1; }
[ "$(echo "$first" | tail -1)" = "$(echo "$second" | tail -1)" ] || { echo "[quickstart] replayed body differs" >&2; exit 1; }
# The agent integration examples (examples/agent_tool_loop.py): a scripted model's tool
# calls in the OpenAI and the Anthropic formats, each retried after a simulated crash,
# one side effect per tool call.
python3 examples/agent_tool_loop.py --format openai
python3 examples/agent_tool_loop.py --format anthropic
if grep -q WARN "$WORK/serve.log"; then
  echo "[quickstart] serve warned on the quick start:" >&2; grep WARN "$WORK/serve.log" >&2; exit 1
fi
kill -TERM "${PIDS[1]}"
wait "${PIDS[1]}" || { echo "[quickstart] serve did not stop cleanly on SIGTERM" >&2; cat "$WORK/serve.log" >&2; exit 1; }
echo "[quickstart] ok: serve on the default config, one call, one replay, clean stop" >&2
