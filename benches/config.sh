# The configs every benchmark runs with, sourced by benches/run.sh, benches/instructions.sh
# and benches/ab_passthrough.sh (each sets WORK, a scratch directory, and UP_PORT, the upstream).

# write_upstream_conf DIR: writes DIR/nginx.conf for the upstream every row goes to, nginx
# answering static JSON on 127.0.0.1:$UP_PORT with `return` (no disk), one worker.
write_upstream_conf() {
  local d=$1; mkdir -p "$d/tmp"
  cat > "$d/nginx.conf" <<EOF
worker_processes 1;
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
  default_type application/json;
  server {
    listen 127.0.0.1:$UP_PORT backlog=4096;
    location = /weather { return 200 '{"city":"paris","temp_c":21,"conditions":"clear"}'; }
    location = /send { return 201 '{"id":"msg_1","status":"queued"}'; }
    # An MCP server's answer to tools/call (the benches' MCP replay row replays it).
    location = /mcp { return 200 '{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"queued msg_1"}],"isError":false}}'; }
    location / { return 200 '{"ok":true}'; }
  }
}
EOF
}

# write_config NAME [retention] [gc_interval] [replay_cache_bytes]: writes
# $WORK/NAME/idemproxy.yaml and prints its path. /api/weather (GET) and /api/echo (POST)
# are read-only pass-through; /api/send is a side effect, keyed by Idempotency-Key;
# /tools/mcp is an MCP server whose `send_email` tool is a side effect.
# LISTEN sets the listen address (default 127.0.0.1:0: the proxy prints the port).
write_config() {
  local name=$1 retention=${2:-24h} gc=${3:-60s} cache=${4:-}
  local d="$WORK/$name"; mkdir -p "$d"
  cat > "$d/idemproxy.yaml" <<EOF
listen: ${LISTEN:-127.0.0.1:0}
store: { backend: redb, path: $d/store.redb, retention: $retention, gc_interval: $gc }
limits: { max_body_bytes: 65536${cache:+, replay_cache_bytes: $cache} }
identity:
  key_header: Idempotency-Key
  derive_from: []
  tenant_from: [Authorization]
upstreams:
  - name: api
    url: http://127.0.0.1:$UP_PORT
    mount: /api
    routes:
      - { name: weather, match: { method: GET, path: /weather }, class: read_only }
      - { name: echo, match: { method: POST, path: /echo }, class: read_only }
      - { name: send, match: { method: POST, path: /send }, tool_version: v1, retention: $retention }
  - name: tools
    url: http://127.0.0.1:$UP_PORT
    mount: /tools
    protocol: mcp
    mcp: { tools: { send_email: { class: side_effect, tool_version: v1, retention: $retention } } }
EOF
  echo "$d/idemproxy.yaml"
}
