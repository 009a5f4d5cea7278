#!/usr/bin/env bash
# The idemproxy benchmark: one run measures, with the same wrk client settings, the
# upstream directly, nginx as a keep-alive reverse proxy, a bare hyper server and proxy
# (benches/hyper_floor.rs), and idemproxy (read-only pass-through, first executions,
# replays), plus the one-commit-per-write baseline, peak
# RSS with 1,000 connections, replay latency from 1k to 1M stored records, and file growth
# under churn. Results go to docs/BENCH_RESULTS.md (between the bench markers;
# docs/PERFORMANCE.md summarises them).
#
#   benches/run.sh                 # full benchmark, twice (RUNS=2), writes the doc
#   RUNS=1 DURATION=5 benches/run.sh --no-doc      # quicker look, doc untouched
#   benches/run.sh --only passthrough              # one scenario group (see `groups` below),
#                                                  # or several: --only passthrough,durable
#
# Everything it starts (two nginx instances, idemproxy) runs from a temp dir and is
# stopped by PID on exit.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
RUNS=${RUNS:-2}
DURATION=${DURATION:-10}   # seconds per wrk measurement
REPS=${REPS:-3}            # rounds of the rows compared with nginx, taken in turn
THREADS=${THREADS:-2}      # wrk threads
CONNS=${CONNS:-32}         # the common client setting
CONNS_FIRST=${CONNS_FIRST:-64}
CONNS_RSS=${CONNS_RSS:-1000}
SCALES=${SCALES:-"1000 10000 100000 1000000"}
SCALE_REPS=${SCALE_REPS:-3} # measurements per store size (the p99 of one run swings by 2x)
CHURN_SECONDS=${CHURN_SECONDS:-30}
WRITE_DOC=1
ONLY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --no-doc) WRITE_DOC=0 ;;
    --only) ONLY="$2"; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

log() { echo "[bench $(date +%H:%M:%S)] $*" >&2; }
# --only takes one group or several separated by commas (passthrough,durable).
want() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }

# --- tools -------------------------------------------------------------------------------
need=()
command -v wrk >/dev/null || need+=(wrk)
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || need+=(nginx)
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]} from Debian's packages"
  apt-get install -y "${need[@]}" >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y "${need[@]}" >/dev/null; }
fi
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
command -v python3 >/dev/null || { echo "python3 is needed for the report" >&2; exit 1; }

log "building (cargo build --release, the hyper floor, store bench tool)"
(cd "$ROOT" && cargo build --release --bins -q && cargo build --release --example hyper_floor -q)
STORE_TOOL=$(cd "$ROOT" && cargo bench --bench store --no-run 2>&1 | sed -n 's/.*(\(target\/release\/deps\/store-[0-9a-f]*\)).*/\1/p' | tail -1)
[ -n "$STORE_TOOL" ] || { echo "cannot find the store bench binary" >&2; exit 1; }
STORE_TOOL="$ROOT/$STORE_TOOL"
PROXY_BIN="$ROOT/target/release/idemproxy"
FLOOR_BIN="$ROOT/target/release/examples/hyper_floor"

WORK=$(mktemp -d /tmp/idemproxy-bench.XXXXXX)
RESULTS="$WORK/results.jsonl"
: > "$RESULTS"
PIDS=()
cleanup() {
  for p in "${PIDS[@]:-}"; do
    [ -n "$p" ] && kill "$p" 2>/dev/null || true
  done
  for p in "${PIDS[@]:-}"; do
    [ -n "$p" ] && wait "$p" 2>/dev/null || true
  done
  rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

wait_port() {
  for _ in $(seq 1 200); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.05
  done
  echo "nothing listens on $1" >&2; return 1
}

stop_pid() {
  kill "$1" 2>/dev/null || true
  wait "$1" 2>/dev/null || true
  local keep=()
  for p in "${PIDS[@]}"; do [ "$p" != "$1" ] && keep+=("$p"); done
  PIDS=("${keep[@]:-}")
}

# --- the upstream: nginx answering static JSON -------------------------------------------
# The same, fast upstream behind every proxy: nginx `return` answers without touching
# disk, so what differs between rows is the proxy. One worker keeps it off the second core.
start_upstream() {
  UP_PORT=$(free_port)
  local d="$WORK/upstream"
  write_upstream_conf "$d"
  "$NGINX" -p "$d" -c "$d/nginx.conf" &
  UP_PID=$!; PIDS+=("$UP_PID")
  wait_port "$UP_PORT"
}

# --- nginx as the reverse proxy users already trust --------------------------------------
# Keep-alive to the upstream, HTTP/1.1, the same forwarding headers idemproxy sets, and
# worker_processes auto (2 here), like idemproxy's two runtime threads.
start_nginx_proxy() {
  NG_PORT=$(free_port)
  local d="$WORK/nginx-proxy"; mkdir -p "$d/tmp"
  cat > "$d/nginx.conf" <<EOF
worker_processes auto;
daemon off;
pid $d/nginx.pid;
error_log $d/error.log warn;
events { worker_connections 8192; }
http {
  access_log off;
  client_body_temp_path $d/tmp; proxy_temp_path $d/tmp; fastcgi_temp_path $d/tmp;
  uwsgi_temp_path $d/tmp; scgi_temp_path $d/tmp;
  keepalive_requests 10000000;
  keepalive_timeout 300s;
  upstream up {
    server 127.0.0.1:$UP_PORT;
    keepalive 256;
    keepalive_requests 10000000;
  }
  server {
    listen 127.0.0.1:$NG_PORT backlog=4096;
    location /api/ {
      proxy_pass http://up/;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header X-Forwarded-For \$proxy_add_x_forwarded_for;
      proxy_set_header X-Forwarded-Host \$host;
      proxy_set_header X-Forwarded-Proto \$scheme;
    }
  }
}
EOF
  "$NGINX" -p "$d" -c "$d/nginx.conf" &
  NG_PID=$!; PIDS+=("$NG_PID")
  wait_port "$NG_PORT"
}

# --- the hyper floor ------------------------------------------------------------------------
# What hyper costs with nothing of idemproxy's around it, on the same machine in the same
# run: a static answer shaped like a replay, and a bare proxy (benches/hyper_floor.rs).
# Same worker threads as idemproxy.
start_floor() {
  FS_PORT=$(free_port); FP_PORT=$(free_port); BS_PORT=$(free_port); BP_PORT=$(free_port)
  "$FLOOR_BIN" static --port "$FS_PORT" > /dev/null &
  FS_PID=$!; PIDS+=("$FS_PID")
  "$FLOOR_BIN" proxy --port "$FP_PORT" --upstream "127.0.0.1:$UP_PORT" --mount /api > /dev/null &
  FP_PID=$!; PIDS+=("$FP_PID")
  # The same two without hyper: hand-written HTTP/1.1 loops (what the socket calls alone cost).
  "$FLOOR_BIN" bare-static --port "$BS_PORT" > /dev/null &
  BS_PID=$!; PIDS+=("$BS_PID")
  "$FLOOR_BIN" bare-proxy --port "$BP_PORT" --upstream "127.0.0.1:$UP_PORT" --mount /api > /dev/null &
  BP_PID=$!; PIDS+=("$BP_PID")
  wait_port "$FS_PORT"; wait_port "$FP_PORT"; wait_port "$BS_PORT"; wait_port "$BP_PORT"
}

# --- idemproxy -----------------------------------------------------------------------------
# write_config (and write_upstream_conf above): benches/config.sh, shared with
# benches/instructions.sh and benches/ab_passthrough.sh.
source "$ROOT/benches/config.sh"

# start_proxy CONFIG: sets PX_PID and PX_PORT.
start_proxy() {
  local cfg=$1 out="$WORK/proxy.$$.$RANDOM.out"
  IDEMPROXY_LOG=${IDEMPROXY_LOG:-warn} "$PROXY_BIN" serve --config "$cfg" > "$out" 2>"$out.err" &
  PX_PID=$!; PIDS+=("$PX_PID")
  # Up to 10 minutes: a start may compact a large store first (see app::open_store_for_serving).
  for _ in $(seq 1 12000); do
    PX_PORT=$(sed -n 's/^idemproxy listening on 127.0.0.1:\([0-9]*\)$/\1/p' "$out")
    [ -n "$PX_PORT" ] && return 0
    kill -0 "$PX_PID" 2>/dev/null || { cat "$out.err" >&2; return 1; }
    sleep 0.05
  done
  echo "idemproxy did not start" >&2; cat "$out.err" >&2; return 1
}

vmhwm_kib() { awk '/^VmHWM/ {print $2}' "/proc/$1/status"; }

# cpu_ticks PID: user + system clock ticks of a process, its threads and its direct
# children (nginx's workers), from /proc.
cpu_ticks() {
  local total=0 p t
  for p in "$1" $(pgrep -P "$1" || true); do
    t=$(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0)
    total=$((total + t))
  done
  echo "$total"
}

# The server whose CPU a row reports: the upstream, nginx or idemproxy, found by port.
server_pid() {
  case "$1" in
    *":$UP_PORT") echo "$UP_PID" ;;
    *":$NG_PORT") echo "$NG_PID" ;;
    *":${FS_PORT:-none}") echo "$FS_PID" ;;
    *":${FP_PORT:-none}") echo "$FP_PID" ;;
    *":${BS_PORT:-none}") echo "$BS_PID" ;;
    *":${BP_PORT:-none}") echo "$BP_PID" ;;
    *) echo "$PX_PID" ;;
  esac
}

# --- the client -----------------------------------------------------------------------------
# measure RUN GROUP NAME CONNS BASE PATH METHOD [keys] [pool] [prefix]: one wrk run, one
# JSON line in the results, with the CPU the server under test used per request.
measure() {
  local run=$1 group=$2 name=$3 conns=$4 base=$5 path=$6 method=$7 keys=${8:-none} pool=${9:-0} prefix=${10:-k}
  local body=0; [ "$method" = POST ] && body=512
  local out pid t0 t1
  pid=$(server_pid "$base"); t0=$(cpu_ticks "$pid")
  out=$(BENCH_METHOD=$method BENCH_PATH="$path" BENCH_BODY=$body BENCH_KEYS=$keys \
        BENCH_POOL=$pool BENCH_PREFIX=$prefix \
        wrk -t"$THREADS" -c"$conns" -d"${DURATION}s" --latency --timeout 10s \
            -s "$ROOT/benches/wrk/request.lua" "$base" 2>&1) || true
  t1=$(cpu_ticks "$pid")
  python3 "$ROOT/benches/report.py" parse-wrk --run "$run" --group "$group" --name "$name" \
      --conns "$conns" --method "$method" --rep "${REP:-1}" \
      --cpu-ticks "$((t1 - t0))" --clk-tck "$(getconf CLK_TCK)" <<<"$out" >> "$RESULTS"
  log "$(tail -1 "$RESULTS")"
}

# warm BASE PATH METHOD: a short untimed run so connections, pools and caches exist.
warm() {
  BENCH_METHOD=$3 BENCH_PATH="$2" BENCH_BODY=512 BENCH_KEYS=none \
    wrk -t1 -c8 -d1s -s "$ROOT/benches/wrk/request.lua" "$1" >/dev/null 2>&1 || true
}

record() { echo "$1" >> "$RESULTS"; log "$1"; }

# prefill RUN CONFIG FROM TO: records r-(FROM+1)..r-TO straight into the store (proxy stopped).
prefill() {
  local p; p=$("$STORE_TOOL" prefill --config "$2" --from "$3" --to "$4")
  record "$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d["run"]=int(sys.argv[2]); print(json.dumps(d))' "$p" "$1")"
}

# baseline RUN WHEN: one durable commit per state write, same store code, sequential, for
# half a measurement (the proxy under test is idle meanwhile).
baseline() {
  local b; b=$("$STORE_TOOL" baseline --dir "$WORK/baseline" --seconds "$(( (DURATION + 1) / 2 ))")
  record "$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d.update(run=int(sys.argv[2]), when=sys.argv[3]); print(json.dumps(d))' "$b" "$1" "$2")"
}

machine() {
  python3 - <<EOF >> "$RESULTS"
import json, os, platform, subprocess
cpu = next((l.split(':',1)[1].strip() for l in open('/proc/cpuinfo') if l.startswith('model name')), '?')
print(json.dumps({"kind": "machine", "nproc": os.cpu_count(), "cpu": cpu,
  "kernel": platform.release(), "loadavg": open('/proc/loadavg').read().split()[:3],
  "nginx": subprocess.run(["$NGINX", "-v"], capture_output=True, text=True).stderr.strip(),
  "wrk": "wrk -t$THREADS -c$CONNS -d${DURATION}s --latency", "duration_s": $DURATION}))
EOF
}

# --- one full run ---------------------------------------------------------------------------
one_run() {
  local run=$1
  log "run $run: starting upstream and nginx"
  start_upstream
  start_nginx_proxy
  start_floor
  local U="http://127.0.0.1:$UP_PORT" N="http://127.0.0.1:$NG_PORT"
  local FS="http://127.0.0.1:$FS_PORT" FP="http://127.0.0.1:$FP_PORT"
  local BS="http://127.0.0.1:$BS_PORT" BP="http://127.0.0.1:$BP_PORT"

  if want passthrough || want durable; then
    local cfg; cfg=$(write_config "main-$run")
    # 10k delivered records for the replay rows, written before the proxy opens the file.
    prefill "$run" "$cfg" 0 10000
    start_proxy "$cfg"
    local P="http://127.0.0.1:$PX_PORT" MAIN_PID=$PX_PID
    warm "$U" "/weather?city=paris" GET; warm "$N" "/api/weather?city=paris" GET; warm "$P" "/api/weather?city=paris" GET
    warm "$U" "/echo" POST; warm "$N" "/api/echo" POST; warm "$P" "/api/echo" POST
    warm "$FP" "/api/weather?city=paris" GET; warm "$FS" "/api/send" POST
    warm "$BP" "/api/weather?city=paris" GET; warm "$BS" "/api/send" POST
  fi
  # The rows compared with nginx are taken in turn, REPS rounds of each: a minute of
  # noise from the machine's other work then lands on every row alike instead of on one,
  # and the report compares the rows round by round (medians of the per-round ratios).
  local REP
  for REP in $(seq 1 "$REPS"); do
    if want passthrough; then
      measure "$run" passthrough direct-get "$CONNS" "$U" "/weather?city=paris" GET
      measure "$run" passthrough nginx-get "$CONNS" "$N" "/api/weather?city=paris" GET
      measure "$run" passthrough idemproxy-get "$CONNS" "$P" "/api/weather?city=paris" GET
      measure "$run" passthrough floor-get "$CONNS" "$FP" "/api/weather?city=paris" GET
      measure "$run" passthrough bare-get "$CONNS" "$BP" "/api/weather?city=paris" GET
      measure "$run" passthrough direct-post "$CONNS" "$U" "/echo" POST
      measure "$run" passthrough nginx-post "$CONNS" "$N" "/api/echo" POST
      measure "$run" passthrough idemproxy-post "$CONNS" "$P" "/api/echo" POST
      measure "$run" passthrough floor-post "$CONNS" "$FP" "/api/echo" POST
      measure "$run" passthrough bare-post "$CONNS" "$BP" "/api/echo" POST
    fi
    if want durable; then
      measure "$run" durable replay-post "$CONNS" "$P" "/api/send" POST pool 10000 r
      measure "$run" durable floor-static-post "$CONNS" "$FS" "/api/send" POST pool 10000 r
      measure "$run" durable bare-static-post "$CONNS" "$BS" "/api/send" POST pool 10000 r
    fi
  done
  REP=1
  if want durable; then
    measure "$run" durable first-post-c$CONNS "$CONNS" "$P" "/api/send" POST unique 0 "a$run$RANDOM"
    # The disk is shared too and its fsync latency moves from minute to minute: the
    # one-commit-per-write baseline runs right before and right after the 64-client row,
    # and the target compares with the mean of the two.
    baseline "$run" before
    measure "$run" durable first-post-c$CONNS_FIRST "$CONNS_FIRST" "$P" "/api/send" POST unique 0 "b$run$RANDOM"
    baseline "$run" after
  fi
  if want passthrough || want durable; then
    record "{\"kind\":\"rss\",\"run\":$run,\"name\":\"main\",\"vmhwm_kib\":$(vmhwm_kib "$MAIN_PID")}"
    stop_pid "$MAIN_PID"
  fi
  if want durable; then
    # The same replays with the replay cache off: what the store path alone costs.
    local cfg; cfg=$(write_config "nocache-$run" 24h 60s 0)
    prefill "$run" "$cfg" 0 10000
    start_proxy "$cfg"
    measure "$run" durable nocache-replay-post "$CONNS" "http://127.0.0.1:$PX_PORT" "/api/send" POST pool 10000 r
    stop_pid "$PX_PID"
  fi

  if want rss; then
    # One fresh proxy per kind of traffic, so each peak is that traffic's own.
    log "run $run: $CONNS_RSS connections, a fresh proxy for each kind of request"
    local kind cfg P
    for kind in get replay first; do
      cfg=$(write_config "rss-$kind-$run")
      [ "$kind" = replay ] && prefill "$run" "$cfg" 0 10000
      start_proxy "$cfg"
      P="http://127.0.0.1:$PX_PORT"
      case $kind in
        get) measure "$run" rss "rss-get-c$CONNS_RSS" "$CONNS_RSS" "$P" "/api/weather?city=paris" GET ;;
        replay) measure "$run" rss "rss-replay-c$CONNS_RSS" "$CONNS_RSS" "$P" "/api/send" POST pool 10000 r ;;
        first) measure "$run" rss "rss-first-c$CONNS_RSS" "$CONNS_RSS" "$P" "/api/send" POST unique 0 "c$run$RANDOM" ;;
      esac
      record "{\"kind\":\"rss\",\"run\":$run,\"name\":\"$kind\",\"conns\":$CONNS_RSS,\"vmhwm_kib\":$(vmhwm_kib "$PX_PID")}"
      stop_pid "$PX_PID"
    done
  fi

  if want scale; then
    log "run $run: replay latency against growing stores"
    # The replay cache is off here: with it, the 1,000-record row is answered from memory
    # and the million-record row from the store, and the rows would compare two paths.
    local cfg; cfg=$(write_config "scale-$run" 24h 60s 0)
    local have=0
    for n in $SCALES; do
      prefill "$run" "$cfg" "$have" "$n"
      have=$n
      start_proxy "$cfg"
      local P="http://127.0.0.1:$PX_PORT"
      warm "$P" "/api/send" POST # (no key: a 400, just opens connections)
      # The p99 of one 10 s run at the same size moved from 1.1 to 4.3 ms on this machine
      # (docs/PERFORMANCE.md, "Method"): each size is measured SCALE_REPS times and the
      # report takes the medians.
      for REP in $(seq 1 "$SCALE_REPS"); do
        measure "$run" scale "replay-$n" "$CONNS" "$P" "/api/send" POST pool "$n" r
      done
      REP=1
      stop_pid "$PX_PID"
    done
    rm -rf "$(dirname "$cfg")" # a million records are over a GiB
  fi

  if want churn; then
    log "run $run: churn (retention 5s, gc every 1s) for ${CHURN_SECONDS}s"
    local cfg; cfg=$(write_config "churn-$run" 5s 1s)
    local db; db="$(dirname "$cfg")/store.redb"
    start_proxy "$cfg"
    local P="http://127.0.0.1:$PX_PORT" max=0 sz sizes=""
    ( DURATION=$CHURN_SECONDS measure "$run" churn "first-post-churn" "$CONNS" "$P" "/api/send" POST unique 0 "d$run$RANDOM" ) &
    local wrk_job=$!
    while kill -0 "$wrk_job" 2>/dev/null; do
      sz=$(stat -c %s "$db" 2>/dev/null || echo 0); [ "$sz" -gt "$max" ] && max=$sz
      sizes="$sizes${sizes:+,}$sz"
      sleep 1
    done
    wait "$wrk_job" || true
    # Stopped right away, the store holds the steady state's live set: the last 5 s of
    # executions (retention) plus what gc has not reached yet.
    local end_size; end_size=$(stat -c %s "$db")
    stop_pid "$PX_PID"
    local live; live=$("$STORE_TOOL" live --config "$cfg")
    # A restart compacts the file (see app::open_store).
    start_proxy "$cfg"; stop_pid "$PX_PID"
    local after; after=$(stat -c %s "$db")
    record "$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d.update(run=int(sys.argv[2]), kind="churn", max_file_bytes=int(sys.argv[3]), file_after_restart=int(sys.argv[4]), seconds=int(sys.argv[5]), file_at_end=int(sys.argv[6]), sizes=[int(x) for x in sys.argv[7].split(",") if x]); print(json.dumps(d))' "$live" "$run" "$max" "$after" "$CHURN_SECONDS" "$end_size" "$sizes")"
  fi

  stop_pid "$FS_PID"
  stop_pid "$FP_PID"
  stop_pid "$BS_PID"
  stop_pid "$BP_PID"
  stop_pid "$NG_PID"
  stop_pid "$UP_PID"
}

machine
for run in $(seq 1 "$RUNS"); do
  one_run "$run"
done
cp "$RESULTS" "$ROOT/target/bench-results.jsonl"
log "raw results: target/bench-results.jsonl"
if [ "$WRITE_DOC" = 1 ]; then
  python3 "$ROOT/benches/report.py" render --results "$RESULTS" --doc "$ROOT/docs/BENCH_RESULTS.md" \
      --command "benches/run.sh"
  log "wrote docs/BENCH_RESULTS.md"
else
  python3 "$ROOT/benches/report.py" render --results "$RESULTS"
fi
