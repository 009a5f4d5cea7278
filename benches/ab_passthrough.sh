#!/usr/bin/env bash
# A/B of two idemproxy builds on read-only pass-through, in alternating 5 s wrk rounds on
# one machine (docs/PERFORMANCE.md, item 25). OLD is another build's binary, e.g.
#   git worktree add /tmp/old 454ce0e && (cd /tmp/old && CARGO_TARGET_DIR=/tmp/old-target cargo build --release --bin idemproxy)
#   OLD_BIN=/tmp/old-target/release/idemproxy benches/ab_passthrough.sh
set -e
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OLD_BIN=${OLD_BIN:?set OLD_BIN to the other build}
(cd "$ROOT" && cargo build --release --bin idemproxy -q)
WORK=$(mktemp -d /tmp/idemproxy-ab.XXXXXX); mkdir -p $WORK/up/tmp
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
UP_PORT=$(free_port)
cat > $WORK/up/nginx.conf <<E2
worker_processes 1; daemon off; pid $WORK/up/nginx.pid; error_log $WORK/up/error.log warn;
events { worker_connections 8192; }
http { access_log off; keepalive_requests 10000000; keepalive_timeout 300s; default_type application/json;
  client_body_temp_path $WORK/up/tmp; proxy_temp_path $WORK/up/tmp; fastcgi_temp_path $WORK/up/tmp; uwsgi_temp_path $WORK/up/tmp; scgi_temp_path $WORK/up/tmp;
  server { listen 127.0.0.1:$UP_PORT; location = /weather { return 200 '{"city":"paris","temp_c":21,"conditions":"clear"}'; } location / { return 200 '{"ok":true}'; } } }
E2
/usr/sbin/nginx -p $WORK/up -c $WORK/up/nginx.conf &
source $ROOT/benches/config.sh
start() { local cfg=$(write_config $1); IDEMPROXY_LOG=warn $2 serve --config $cfg > $WORK/$1.out 2>&1 & sleep 1; sed -n 's/^idemproxy listening on 127.0.0.1:\([0-9]*\)$/\1/p' $WORK/$1.out; }
NEW=$(start new $ROOT/target/release/idemproxy); OLD=$(start old $OLD_BIN)
BODY=$(python3 -c 'import json;print(json.dumps({"pad":"x"*490}))')
echo "wrk.method='POST'; wrk.body='$BODY'; wrk.headers['Content-Type']='application/json'" > $WORK/post.lua
for p in $NEW $OLD; do wrk -t2 -c32 -d2s http://127.0.0.1:$p/api/weather?city=paris >/dev/null; done
for r in 1 2 3; do
 for v in old new; do p=$([ $v = new ] && echo $NEW || echo $OLD)
  g=$(wrk -t2 -c32 -d5s http://127.0.0.1:$p/api/weather?city=paris | awk '/Requests\/sec/ {print int($2)}')
  q=$(wrk -t2 -c32 -d5s -s $WORK/post.lua http://127.0.0.1:$p/api/echo | awk '/Requests\/sec/ {print int($2)}')
  echo "round $r $v GET $g POST $q"
 done
done
pkill -f "$WORK/new/idemproxy.yaml" || true; pkill -f "$WORK/old/idemproxy.yaml" || true; kill $(cat $WORK/up/nginx.pid); rm -rf $WORK
