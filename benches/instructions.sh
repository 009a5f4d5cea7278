#!/usr/bin/env bash
# User-space instructions per request, counted by callgrind: the same figure from run to
# run whatever else the machine is doing, so a change worth a few percent shows, where
# wall-clock runs on this shared machine move by ±15% (docs/PERFORMANCE.md, "Method").
#
#   benches/instructions.sh            # N=2000 requests per row
#   N=500 benches/instructions.sh      # quicker
#   KEEP=/tmp/cg ROWS="idemproxy-get floor-proxy" benches/instructions.sh
#                                      # some rows; keep callgrind's files for callgrind_annotate
#   REPLAY_CACHE=0 ROWS=idemproxy-replay benches/instructions.sh
#                                      # replays from the store (limits.replay_cache_bytes: 0)
#   ROWS=idemproxy-mcp-replay benches/instructions.sh
#                                      # MCP tools/call replays (from the store, a new JSON-RPC
#                                      # id each), to compare with REPLAY_CACHE=0's HTTP replay
#
# Each row starts its server under `valgrind --tool=callgrind --instr-atstart=no` with one
# worker thread, warms it up (connections, pools, and for replays: every key executed,
# then replayed once from the store so it is in the replay cache), switches counting on
# for exactly N requests sent in turn on one keep-alive connection, and prints the count
# per request. valgrind hides the CPU's SHA extensions, so sha2 runs its portable code
# under it: SHA-256 is printed apart. System time (about half of every request) is not
# counted. Rows: idemproxy pass-through GET and POST and replays from memory; the bare
# hyper proxy (GET and POST) and static answer (benches/hyper_floor.rs); on request
# (ROWS="floor-raw floor-raw-post"), the bare hyper server with a hand-written upstream
# client (docs/PERFORMANCE.md, "Upstream clients").
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
N=${N:-2000}
command -v valgrind >/dev/null || { echo "valgrind is needed (Debian package valgrind)" >&2; exit 1; }
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || apt-get install -y nginx >/dev/null
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
(cd "$ROOT" && cargo build --release --bins -q && cargo build --release --example hyper_floor -q)

WORK=$(mktemp -d /tmp/idemproxy-instructions.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() {
  for _ in $(seq 1 600); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.05; done
  echo "nothing listens on $1" >&2; return 1
}

# write_upstream_conf, write_config: benches/config.sh, shared with benches/run.sh.
source "$ROOT/benches/config.sh"

# The upstream: nginx answering static JSON, as in benches/run.sh.
UP_PORT=$(free_port)
write_upstream_conf "$WORK/up"
"$NGINX" -p "$WORK/up" -c "$WORK/up/nginx.conf" & PIDS+=($!)
wait_port "$UP_PORT"

# send PORT COUNT MODE: COUNT requests in turn on one connection (MODE get, post, replay).
send() {
  python3 - "$@" <<'EOF'
import socket, sys, random
port, n, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
body = '{"to":"user@example.com","subject":"bench","text":"' + 'x' * 459 + '"}'
s = socket.create_connection(("127.0.0.1", port))
random.seed(1)
buf = b""
for i in range(n):
    if mode == "get":
        req = f"GET /api/weather?city=paris HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n"
    elif mode == "mcp-replay":
        # A tools/call with the same arguments as the HTTP replay's body, a new JSON-RPC id
        # on every request (as MCP clients retry), keyed by Idempotency-Key.
        rpc = ('{"jsonrpc":"2.0","id":' + str(i + 1) + ',"method":"tools/call","params":'
               '{"name":"send_email","arguments":' + body + '}}')
        req = (f"POST /tools/mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
               f"Accept: application/json, text/event-stream\r\nMCP-Protocol-Version: 2025-06-18\r\n"
               f"Idempotency-Key: m-{random.randint(1, 100)}\r\nContent-Length: {len(rpc)}\r\n\r\n{rpc}")
    else:
        path, key = ("/api/send", f"Idempotency-Key: r-{random.randint(1, 100)}\r\n") if mode == "replay" else ("/api/echo", "")
        req = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
               f"{key}Content-Length: {len(body)}\r\n\r\n{body}")
    s.sendall(req.encode())
    while b"\r\n\r\n" not in buf:
        buf += s.recv(65536)
    head, _, rest = buf.partition(b"\r\n\r\n")
    status = head.split(b" ", 2)[1]
    if not status.startswith(b"2"):
        sys.exit(f"request {i}: status {status.decode()}")
    length = next((int(l.split(b":")[1]) for l in head.split(b"\r\n")[1:]
                   if l.lower().startswith(b"content-length:")), 0)
    while len(rest) < length:
        rest += s.recv(65536)
    buf = rest[length:]
EOF
}

# count NAME MODE PORT COMMAND...: one row, the server COMMAND listening on PORT.
count() {
  local name=$1 mode=$2 port=$3; shift 3
  local d="$WORK/$name"; mkdir -p "$d"
  IDEMPROXY_LOG=warn IDEMPROXY_WORKERS=1 valgrind --tool=callgrind --instr-atstart=no \
    --callgrind-out-file="$d/cg.out" "$@" > "$d/out" 2> "$d/err" &
  local vp=$!; PIDS+=("$vp")
  wait_port "$port"
  send "$port" 400 "$mode"; send "$port" 200 "$mode"
  callgrind_control -i on "$vp" > /dev/null 2>&1
  send "$port" "$N" "$mode"
  callgrind_control -i off "$vp" > /dev/null 2>&1
  kill -TERM "$vp"; wait "$vp" 2>/dev/null || true
  if [ -n "${KEEP:-}" ]; then mkdir -p "$KEEP"; cp "$d/cg.out" "$KEEP/$name.cg.out"; fi
  python3 - "$d/cg.out" "$N" "$name" <<'EOF'
import re, subprocess, sys
f, n, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
out = subprocess.run(["callgrind_annotate", "--auto=no", "--threshold=100", f],
                     capture_output=True, text=True, check=True).stdout
total = sha = 0
for line in out.splitlines():
    m = re.match(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+(.*)$", line)
    if not m or "PROGRAM TOTALS" in line:
        continue
    ir = int(m.group(1).replace(",", ""))
    total += ir
    if re.search(r"sha2|compress256|block.buffer", m.group(2)):
        sha += ir
print(f"| {name} | {total / n:,.0f} | {sha / n:,.0f} | {(total - sha) / n:,.0f} |")
EOF
}

# proxy_row NAME MODE: idemproxy with a store of its own.
proxy_row() {
  local name=$1 mode=$2 port cfg; port=$(free_port)
  cfg=$(LISTEN="127.0.0.1:$port" write_config "$name" 24h 60s ${REPLAY_CACHE:-})
  count "$name" "$mode" "$port" "$ROOT/target/release/idemproxy" serve --config "$cfg"
}

# floor_proxy_row NAME MODE [KIND]: the bare hyper proxy (KIND `proxy`, the default) or the
# bare hyper server with a hand-written upstream client (`raw`) in front of the same upstream.
floor_proxy_row() {
  local port; port=$(free_port)
  count "$1" "$2" "$port" "$FLOOR" "${3:-proxy}" --port "$port" --upstream "127.0.0.1:$UP_PORT" --mount /api
}

echo "Instructions per request (callgrind, one worker, $N requests in turn on one connection):"
echo
echo "| row | all | SHA-256 (portable under valgrind) | beside SHA-256 |"
echo "|---|---:|---:|---:|"
ROWS=${ROWS:-idemproxy-get idemproxy-post idemproxy-replay floor-proxy floor-proxy-post floor-static}
FLOOR="$ROOT/target/release/examples/hyper_floor"
for row in $ROWS; do
  case $row in
    idemproxy-get) proxy_row idemproxy-get get ;;
    idemproxy-post) proxy_row idemproxy-post post ;;
    idemproxy-replay) proxy_row idemproxy-replay replay ;;
    idemproxy-mcp-replay) proxy_row idemproxy-mcp-replay mcp-replay ;;
    floor-proxy) floor_proxy_row floor-proxy get ;;
    floor-proxy-post) floor_proxy_row floor-proxy-post post ;;
    floor-raw) floor_proxy_row floor-raw get raw ;;
    floor-raw-post) floor_proxy_row floor-raw-post post raw ;;
    floor-bare) floor_proxy_row floor-bare get bare-proxy ;;
    floor-bare-post) floor_proxy_row floor-bare-post post bare-proxy ;;
    floor-static) port=$(free_port); count floor-static replay "$port" "$FLOOR" static --port "$port" ;;
    *) echo "unknown row $row" >&2; exit 1 ;;
  esac
done
