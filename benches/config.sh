# The idemproxy config every benchmark runs with, sourced by benches/run.sh and
# benches/instructions.sh (both set WORK, a scratch directory, and UP_PORT, the upstream).

# write_config NAME [retention] [gc_interval] [replay_cache_bytes]: writes
# $WORK/NAME/idemproxy.yaml and prints its path. /api/weather (GET) and /api/echo (POST)
# are read-only pass-through; /api/send is a side effect, keyed by Idempotency-Key.
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
EOF
  echo "$d/idemproxy.yaml"
}
