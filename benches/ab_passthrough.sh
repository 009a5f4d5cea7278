#!/usr/bin/env bash
# A/B of two idemproxy builds on read-only pass-through and replays from memory, in
# alternating 5 s wrk rounds on one machine (docs/PERFORMANCE.md, "Method"). OLD is
# another build's binary, e.g.
#   git worktree add /tmp/old 454ce0e && (cd /tmp/old && CARGO_TARGET_DIR=/tmp/old-target cargo build --release --bin idemproxy)
#   OLD_BIN=/tmp/old-target/release/idemproxy benches/ab_passthrough.sh
#   OLD_BIN=... ROWS="replay" ROUNDS=6 benches/ab_passthrough.sh   # some rows, more rounds
# Rows: GET and POST pass-through, replay (1,000 keys executed and replayed once in an
# untimed warm-up, so every timed replay is answered from memory).
set -e
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OLD_BIN=${OLD_BIN:?set OLD_BIN to the other build}
(cd "$ROOT" && cargo build --release --bin idemproxy -q)
WORK=$(mktemp -d /tmp/idemproxy-ab.XXXXXX)
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
UP_PORT=$(free_port)
source "$ROOT/benches/config.sh"
write_upstream_conf $WORK/up
/usr/sbin/nginx -p $WORK/up -c $WORK/up/nginx.conf &
start() { local cfg=$(write_config $1); IDEMPROXY_LOG=warn $2 serve --config $cfg > $WORK/$1.out 2>&1 & sleep 1; sed -n 's/^idemproxy listening on 127.0.0.1:\([0-9]*\)$/\1/p' $WORK/$1.out; }
NEW=$(start new $ROOT/target/release/idemproxy); OLD=$(start old $OLD_BIN)
# The benchmark's one request generator (benches/wrk/request.lua), as in benches/run.sh.
REQ="$ROOT/benches/wrk/request.lua"
get() { BENCH_METHOD=GET BENCH_PATH="/api/weather?city=paris" wrk -t2 -c32 -d$2 -s "$REQ" http://127.0.0.1:$1; }
post() { BENCH_METHOD=POST BENCH_PATH=/api/echo BENCH_BODY=512 wrk -t2 -c32 -d$2 -s "$REQ" http://127.0.0.1:$1; }
replay() { BENCH_METHOD=POST BENCH_PATH=/api/send BENCH_BODY=512 BENCH_KEYS=pool BENCH_POOL=1000 BENCH_PREFIX=r wrk -t2 -c32 -d$2 -s "$REQ" http://127.0.0.1:$1; }
ROWS=${ROWS:-"get post replay"}
rps() { awk '/Requests\/sec/ {print int($2)}'; }
for p in $NEW $OLD; do get $p 2s >/dev/null; replay $p 3s >/dev/null; done
for r in $(seq 1 "${ROUNDS:-3}"); do
 for v in old new; do p=$([ $v = new ] && echo $NEW || echo $OLD)
  line="round $r $v"
  for row in $ROWS; do line="$line $row $($row $p 5s | rps)"; done
  echo "$line"
 done
done
pkill -f "$WORK/new/idemproxy.yaml" || true; pkill -f "$WORK/old/idemproxy.yaml" || true; kill $(cat $WORK/up/nginx.pid); rm -rf $WORK
