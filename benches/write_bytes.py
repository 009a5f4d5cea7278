# Bytes the proxy process writes per first execution (redb, fsync'd), from /proc/PID/io.
#
#   python3 benches/write_bytes.py target/release/idemproxy 4000 16
#
# BINARY N CONNECTIONS: N first executions (unique keys, an operation and a tool call id
# each, so every search index gets its entry) on CONNECTIONS keep-alive connections, after
# 2,000 to give the file some size. Needs target/release/fake-downstream (cargo build
# --release --bins). Prints KiB written per execution and executions per second.
import http.client, os, subprocess, sys, tempfile, threading, time, json
binary, n, conns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
d = tempfile.mkdtemp()
cfg = f"""listen: 127.0.0.1:18090
store: {{ backend: redb, path: {d}/s.redb, retention: 24h }}
identity: {{ derive_from: [X-Operation-Id, X-Model-Round, X-Tool-Call-Id] }}
upstreams:
  - name: api
    url: http://127.0.0.1:19091
    mount: /api
    routes:
      - {{ name: send, match: {{ method: POST, path: /send }} }}
"""
open(f"{d}/c.yaml", "w").write(cfg)
ds = subprocess.Popen([os.path.join(os.path.dirname(os.path.abspath(binary)), "fake-downstream"), "--listen", "127.0.0.1:19091"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
px = subprocess.Popen([binary, "serve", "--init-store", "--config", f"{d}/c.yaml"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "IDEMPROXY_LOG": "warn"})
time.sleep(1.5)
def wb():
    for line in open(f"/proc/{px.pid}/io"):
        if line.startswith("write_bytes"): return int(line.split()[1])
body = json.dumps({"to": "user@example.com", "subject": "bench", "text": "x" * 400})
def worker(w, count, warm):
    c = http.client.HTTPConnection("127.0.0.1", 18090)
    for i in range(count):
        k = f"{warm}-{w}-{i}"
        c.request("POST", "/api/send", body, {"Content-Type": "application/json", "Idempotency-Key": "k" + k, "X-Operation-Id": "op" + k[:6], "X-Tool-Call-Id": "call_" + k})
        r = c.getresponse(); r.read()
        assert r.status == 201, r.status
def run(total, warm):
    ts = [threading.Thread(target=worker, args=(w, total // conns, warm)) for w in range(conns)]
    [t.start() for t in ts]; [t.join() for t in ts]
run(2000, "w")  # warm: a file of some size
time.sleep(1)
b0 = wb(); t0 = time.time()
run(n, "m")
time.sleep(1.0)
b1 = wb()
print(f"{binary}: {(b1 - b0) / n / 1024:.1f} KiB written per first execution ({n} executions, {conns} connections, {n / (time.time() - t0 - 1):.0f}/s)")
px.terminate(); ds.terminate(); px.wait(); ds.wait()
