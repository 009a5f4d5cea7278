#!/usr/bin/env bash
# Where a proxy's slow requests spend their time (docs/PERFORMANCE.md, "Method"). Runs one
# wrk load against a proxy already listening on 127.0.0.1:PORT and, in its middle
# seconds, traces every request with bpftrace on the kernel's socket tracepoints
# (sock:sock_send_length, sock:sock_recv_length; no kprobes, no kernel headers). Each
# request is split at the kernel's socket calls into:
#
#   before  wrk's send of the request  -> the proxy's first read of it
#   inside  the proxy's read           -> the proxy's send of the response
#   after   the proxy's send           -> wrk's read of the response
#   upstream (measured apart)          the proxy's send to its upstream -> its read back
#
# and prints, for all requests and for the slow ones (end to end over SLOW_MS), how many
# crossed each threshold, plus which part was the largest for each slow request.
#
#   benches/tail.sh --port 8080 --pids 1234            # idemproxy (one process)
#   benches/tail.sh --port 8081 --pids 2001,2002       # nginx: its worker processes
#   METHOD=POST benches/tail.sh --port 8080 --pids 1234
#
# Needs root and bpftrace (installed from Debian's packages if missing). Same client as
# benches/run.sh: wrk -t2 -c32 and benches/wrk/request.lua; one wrk must be the only one
# running, since wrk's sockets are found by the process name.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PORT="" PIDS=""
METHOD=${METHOD:-GET}
SECONDS_TRACED=${SECONDS_TRACED:-5}
SLOW_MS=${SLOW_MS:-2}
while [ $# -gt 0 ]; do
  case "$1" in
    --port) PORT="$2"; shift ;;
    --pids) PIDS="$2"; shift ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$PORT" ] && [ -n "$PIDS" ] || { echo "usage: benches/tail.sh --port PORT --pids PID[,PID...]" >&2; exit 2; }
for tool in bpftrace wrk; do
  command -v "$tool" >/dev/null || apt-get install -y "$tool" >/dev/null 2>&1 \
    || { apt-get update >/dev/null && apt-get install -y "$tool" >/dev/null; }
done

# The proxy's processes, as a bpftrace predicate: pid == A || pid == B.
pred=$(echo "$PIDS" | tr ',' '\n' | sed 's/^/pid == /' | paste -sd'|' | sed 's/|/ || /g')
slow_ns=$((SLOW_MS * 1000000))
prog=$(mktemp /tmp/idemproxy-tail.XXXXXX.bt)
trap 'rm -f "$prog"' EXIT
# Sockets are keyed by wrk's local port: wrk sees it as its own port (skc_num), the proxy
# as the peer's (skc_dport, network byte order). Times are in µs in the histograms.
cat > "$prog" <<EOF
tracepoint:sock:sock_send_length /comm == "wrk" && args->ret > 0/ {
  \$sk = (struct sock *)args->sk;
  @sent[\$sk->__sk_common.skc_num] = nsecs;
}
tracepoint:sock:sock_recv_length /($pred) && args->ret > 0/ {
  \$sk = (struct sock *)args->sk;
  if (\$sk->__sk_common.skc_num == $PORT) {
    \$d = \$sk->__sk_common.skc_dport;
    \$p = ((\$d & 0xff) << 8) | (\$d >> 8);
    if (@sent[\$p] && !@read[\$p]) {
      @read[\$p] = nsecs;
      @before_us[\$p] = (nsecs - @sent[\$p]) / 1000;
      @before = hist(@before_us[\$p]);
    }
  } else if (@up_sent[\$sk]) {
    @upstream = hist((nsecs - @up_sent[\$sk]) / 1000);
    delete(@up_sent[\$sk]);
  }
}
tracepoint:sock:sock_send_length /($pred) && args->ret > 0/ {
  \$sk = (struct sock *)args->sk;
  if (\$sk->__sk_common.skc_num == $PORT) {
    \$d = \$sk->__sk_common.skc_dport;
    \$p = ((\$d & 0xff) << 8) | (\$d >> 8);
    if (@read[\$p]) {
      @inside_us[\$p] = (nsecs - @read[\$p]) / 1000;
      @inside = hist(@inside_us[\$p]);
      delete(@read[\$p]);
      @answered[\$p] = nsecs;
    }
  } else {
    @up_sent[\$sk] = nsecs;
  }
}
tracepoint:sock:sock_recv_length /comm == "wrk" && args->ret > 0/ {
  \$sk = (struct sock *)args->sk;
  \$p = \$sk->__sk_common.skc_num;
  if (@sent[\$p] && @answered[\$p]) {
    \$total = nsecs - @sent[\$p];
    \$after = (nsecs - @answered[\$p]) / 1000;
    @end_to_end = hist(\$total / 1000);
    @after = hist(\$after);
    @requests = count();
    if (\$total > $slow_ns) {
      @slow = count();
      \$b = @before_us[\$p]; \$i = @inside_us[\$p];
      if (\$b >= \$i && \$b >= \$after) { @slow_mostly["before"] = count(); }
      else if (\$i >= \$after) { @slow_mostly["inside"] = count(); }
      else { @slow_mostly["after"] = count(); }
    }
  }
  delete(@sent[\$p]); delete(@answered[\$p]);
}
END {
  clear(@sent); clear(@read); clear(@answered); clear(@up_sent);
  clear(@before_us); clear(@inside_us);
}
EOF

REQ="$ROOT/benches/wrk/request.lua"
body=0; path="/api/weather?city=paris"
[ "$METHOD" = POST ] && { body=512; path=/api/echo; }
out=$(mktemp /tmp/idemproxy-tail.XXXXXX.out)
BENCH_METHOD=$METHOD BENCH_PATH="$path" BENCH_BODY=$body \
  wrk -t2 -c32 -d$((SECONDS_TRACED + 4))s --latency -s "$REQ" "http://127.0.0.1:$PORT" > "$out.wrk" 2>&1 &
WRK=$!
sleep 2
timeout -s INT "$SECONDS_TRACED" bpftrace "$prog" > "$out" 2>"$out.err" || true
wait "$WRK" || true
grep BENCH_RESULT "$out.wrk" || { cat "$out.wrk" "$out.err" >&2; exit 1; }
python3 - "$out" "$SLOW_MS" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
slow_ms = float(sys.argv[2])
hists, counts, mostly = {}, {}, {}
name = None
units = {"": 1, "K": 1024, "M": 1024 * 1024}
for line in text.splitlines():
    m = re.match(r"^@(\w+)(?:\[(\w+)\])?:\s*(\d+)?\s*$", line)
    if m:
        name = m.group(1)
        if m.group(3) is not None:
            if m.group(2):
                mostly[m.group(2)] = int(m.group(3))
            else:
                counts[name] = int(m.group(3))
        else:
            hists[name] = []
        continue
    m = re.match(r"^\[(\d+)([KM]?)(?:, (\d+)([KM]?))?[)\]]\s+(\d+)", line)
    if m and name in hists:
        low = int(m.group(1)) * units[m.group(2)]
        hists[name].append((low, int(m.group(5))))
n = counts.get("requests", 0)
if n == 0:
    sys.exit("no request traced: is --port the proxy's listener and --pids its processes?")
print(f"traced requests: {n}; slow (end to end > {slow_ms:g} ms): {counts.get('slow', 0)} "
      f"({100 * counts.get('slow', 0) / n:.2f}%)")
print("part      >=1.02 ms >=2.05 ms >=4.10 ms (requests whose part took that long or longer)")
for part in ("end_to_end", "before", "inside", "upstream", "after"):
    rows = hists.get(part, [])
    over = lambda us: sum(c for low, c in rows if low >= us)
    print(f"{part:<10} {over(1024):>7}   {over(2048):>7}   {over(4096):>7}")
if mostly:
    print("slow requests by their largest part: " +
          ", ".join(f"{k} {v}" for k, v in sorted(mostly.items(), key=lambda kv: -kv[1])))
PY
rm -f "$out" "$out.wrk" "$out.err"
