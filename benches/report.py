#!/usr/bin/env python3
"""Turns benches/run.sh results into the tables of docs/BENCH_RESULTS.md.

  report.py parse-wrk --run N --group G --name X --conns C --method M < wrk-output
      one JSON line from the BENCH_RESULT line benches/wrk/request.lua prints
  report.py render --results FILE [--doc docs/BENCH_RESULTS.md --command CMD]
      markdown tables and target ratios per run; with --doc, replaces the text between
      the bench markers in the doc (the rest of the doc is written by hand)
"""

import argparse
import json
import re
import statistics
import sys

BEGIN = "<!-- bench:begin (written by benches/run.sh; edits here are overwritten) -->"
END = "<!-- bench:end -->"
MIB = 1024 * 1024
CONNS_MAIN = "32/64"


def parse_wrk(a):
    text = sys.stdin.read()
    m = re.search(r"^BENCH_RESULT (.*)$", text, re.M)
    row = {"kind": "wrk", "run": a.run, "group": a.group, "name": a.name,
           "conns": a.conns, "method": a.method, "rep": a.rep}
    if not m:
        row["error"] = text.strip()[-400:]
        print(json.dumps(row))
        return
    f = {k: int(v) for k, v in (kv.split("=") for kv in m.group(1).split())}
    row.update(
        requests=f["requests"],
        rps=f["requests"] / (f["duration_us"] / 1e6),
        p50_ms=f["p50_us"] / 1000, p90_ms=f["p90_us"] / 1000,
        p99_ms=f["p99_us"] / 1000, max_ms=f["max_us"] / 1000,
        non2xx=f["status"], socket_errors=f["connect"] + f["read"] + f["write"] + f["timeout"],
    )
    if a.cpu_ticks is not None and f["requests"]:
        # The server under test's user + system CPU over the wrk run, per request.
        row["cpu_us_per_req"] = a.cpu_ticks / a.clk_tck * 1e6 / f["requests"]
    print(json.dumps(row))


def fmt_rps(x):
    return f"{x:,.0f}"


def verdict(ok):
    return "**met**" if ok else "**not met**"


def merge_rounds(rows):
    """One row per scenario: a scenario measured in several rounds gets the median of each
    figure, the sums of its counts, and `rounds`, its rows in round order."""
    by_name = {}
    for r in rows:
        if r["kind"] == "wrk":
            by_name.setdefault(r["name"], []).append(r)
    wrk = {}
    for name, rs in by_name.items():
        ok = [r for r in rs if "rps" in r]
        if len(rs) == 1 or not ok:
            wrk[name] = rs[-1]
            continue
        m = dict(ok[0])
        for k in ("rps", "p50_ms", "p90_ms", "p99_ms", "max_ms", "cpu_us_per_req"):
            if all(k in r for r in ok):
                m[k] = statistics.median(r[k] for r in ok)
        for k in ("requests", "non2xx", "socket_errors"):
            m[k] = sum(r[k] for r in ok)
        m["rounds"] = sorted(ok, key=lambda r: r.get("rep", 1))
        wrk[name] = m
    return wrk


def paired(a, b, f):
    """f over the rounds of a and b taken side by side (their median), or f of the merged
    rows when they were not measured in the same rounds."""
    ra, rb = a.get("rounds"), b.get("rounds")
    if ra and rb and [r.get("rep") for r in ra] == [r.get("rep") for r in rb]:
        xs = [f(x, y) for x, y in zip(ra, rb)]
        return statistics.median(xs), xs
    return f(a, b), None


def render_run(run, rows):
    wrk = merge_rounds(rows)
    bases = [r for r in rows if r["kind"] == "baseline"]
    base = None
    if bases:
        # The mean of the runs around the 64-client row (see run.sh `baseline`).
        base = dict(bases[0])
        for k in ("raw_commits_per_s", "writes_per_s", "executions_per_s", "write_p50_ms", "write_p99_ms"):
            base[k] = sum(b[k] for b in bases) / len(bases)
        base["each"] = [b["executions_per_s"] for b in bases]
    rss = {r["name"]: r for r in rows if r["kind"] == "rss"}
    churn = next((r for r in rows if r["kind"] == "churn"), None)
    prefills = [r for r in rows if r["kind"] == "prefill"]
    out = [f"### Run {run}", ""]

    labels = {
        "direct-get": "upstream direct, GET",
        "nginx-get": "nginx reverse proxy, GET",
        "idemproxy-get": "idemproxy read-only pass-through, GET",
        "direct-post": "upstream direct, POST 512 B JSON",
        "nginx-post": "nginx reverse proxy, POST 512 B JSON",
        "idemproxy-post": "idemproxy read-only pass-through, POST 512 B JSON",
        "replay-post": "idemproxy replays (10k stored, random keys), POST 512 B",
        "floor-get": "bare hyper proxy (benches/hyper_floor.rs), GET",
        "floor-post": "bare hyper proxy (benches/hyper_floor.rs), POST 512 B JSON",
        "floor-static-post": "bare hyper static answer shaped like a replay, POST 512 B",
        "bare-get": "hand-written HTTP/1.1 proxy, no hyper (benches/hyper_floor.rs), GET",
        "bare-post": "hand-written HTTP/1.1 proxy, no hyper (benches/hyper_floor.rs), POST 512 B JSON",
        "bare-static-post": "hand-written HTTP/1.1 static answer, no hyper, POST 512 B",
        "nocache-replay-post": "idemproxy replays, replay cache off (every replay reads redb), POST 512 B",
    }
    order = ["direct-get", "nginx-get", "idemproxy-get", "floor-get", "bare-get", "direct-post",
             "nginx-post", "idemproxy-post", "floor-post", "bare-post", "replay-post",
             "floor-static-post", "bare-static-post", "nocache-replay-post"]
    order += sorted((n for n in wrk if re.fullmatch(r"first-post-c\d+", n)),
                    key=lambda n: int(n.rsplit("c", 1)[1]))
    order += [n for n in wrk if n.startswith("rss-")]
    out += ["| scenario | conns | req/s | p50 ms | p99 ms | server CPU µs/req | non-2xx | socket errors |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for n in order:
        r = wrk.get(n)
        if not r:
            continue
        label = labels.get(n, n)
        if n.startswith("first-post-c"):
            label = "idemproxy first executions (unique keys), POST 512 B"
        if n.startswith("rss-get-"):
            label = "idemproxy read-only pass-through, GET (fresh proxy)"
        if n.startswith("rss-replay-"):
            label = "idemproxy replays, POST 512 B (fresh proxy)"
        if n.startswith("rss-first-"):
            label = "idemproxy first executions, POST 512 B (fresh proxy)"
        if "error" in r:
            out.append(f"| {label} | {r['conns']} | failed: {r['error'][:80]} | | | | | |")
            continue
        rounds = r.get("rounds")
        rps = fmt_rps(r["rps"])
        if rounds:
            rps += f" (median of {' / '.join(fmt_rps(x['rps']) for x in rounds)})"
        cpu = f"{r['cpu_us_per_req']:.1f}" if "cpu_us_per_req" in r else ""
        out.append(f"| {label} | {r['conns']} | {rps} | {r['p50_ms']:.2f} | "
                   f"{r['p99_ms']:.2f} | {cpu} | {r['non2xx']} | {r['socket_errors']} |")
    out.append("")
    if any(r.get("rounds") for r in wrk.values()):
        n = max(len(r.get("rounds") or []) for r in wrk.values())
        out += [f"Rows with several figures were measured in {n} rounds, taken in turn with the "
                "other such rows; the row shows the medians, and the targets below compare "
                "them round by round.", ""]

    if base:
        out += ["One durable commit per state write (same store, sequential, every write "
                "waits for its own `Durability::Immediate` commit):", "",
                "| measure | value |", "|---|---:|",
                f"| raw redb commits/s (one 1 KiB insert each) | {fmt_rps(base['raw_commits_per_s'])} |",
                f"| store writes/s (claim or update, one per commit) | {fmt_rps(base['writes_per_s'])} |",
                f"| store write latency p50 / p99 ms | {base['write_p50_ms']:.2f} / {base['write_p99_ms']:.2f} |",
                f"| executions/s (claim `executing` + update `committed`) | {fmt_rps(base['executions_per_s'])} |",
                f"| executions/s measured before / after the 64-client row | {' / '.join(fmt_rps(x) for x in base['each'])} |",
                "", "(Means of the measurements taken right before and right after the 64-client row.)", ""]

    scale = sorted(((int(n.split("-")[1]), r) for n, r in wrk.items()
                    if n.startswith("replay-") and n != "replay-post"), key=lambda x: x[0])
    if scale:
        # The scale rows' prefills are the run's last ones, each growing the same file.
        files = {}
        total = 0
        for p in prefills[-len(scale):]:
            total += p["records"]
            files[total] = p["file_bytes"]
        out += ["Replays against a growing store (random keys over all stored records, "
                f"{scale[0][1]['conns']} connections, replay cache off: every replay reads the store):", "",
                "| stored records | file MiB | req/s | p50 ms | p99 ms | non-2xx |",
                "|---:|---:|---:|---:|---:|---:|"]
        for n, r in scale:
            if "error" in r:
                out.append(f"| {n:,} | | failed | | | |")
                continue
            fb = files.get(n)
            p99 = f"{r['p99_ms']:.2f}"
            if r.get("rounds"):
                each = " / ".join(f"{x['p99_ms']:.2f}" for x in r["rounds"])
                p99 += f" (median of {each})"
            mib = f"{fb / MIB:,.0f}" if fb else ""
            out.append(f"| {n:,} | {mib} | {fmt_rps(r['rps'])} | {r['p50_ms']:.2f} | {p99} | {r['non2xx']} |")
        out.append("")
        if any(r.get("rounds") for _, r in scale):
            out += ["Each size was measured in several consecutive runs on the same proxy; the "
                    "row shows their medians, and the target below compares the medians.", ""]

    if churn:
        live = max(churn["live_bytes"], 1)
        cw = wrk.get("first-post-churn", {})
        out += [f"Churn: first executions for {churn['seconds']} s, {cw.get('conns', '?')} connections, "
                "on a route with 5 s retention and gc every second:", "",
                "| measure | value |", "|---|---:|",
                f"| first executions in the churn run | {cw.get('requests', 0):,} ({fmt_rps(cw.get('rps', 0))}/s) |",
                f"| live records when it ended (within retention) | {churn['records']:,} |",
                f"| live data (record keys + values + index entries) | {churn['live_bytes'] / MIB:.2f} MiB |",
                f"| largest file size seen (sampled every second) | {churn['max_file_bytes'] / MIB:.2f} MiB ({churn['max_file_bytes'] / live:.1f}× live) |",
                f"| file size every {max(1, len(churn.get('sizes', [])) // 6)} s (MiB) | {' '.join(f'{x / MIB:.0f}' for x in churn.get('sizes', [])[::max(1, len(churn.get('sizes', [])) // 6)])} |",
                f"| file when it ended | {churn.get('file_at_end', churn['file_bytes']) / MIB:.2f} MiB ({churn.get('file_at_end', churn['file_bytes']) / live:.1f}× live) |",
                f"| file after a restart (startup compaction if worth it) | {churn['file_after_restart'] / MIB:.2f} MiB ({churn['file_after_restart'] / live:.1f}× live) |",
                ""]

    # Targets, as ratios within this run only.
    t = ["| target | measured | verdict |", "|---|---|---|"]

    def ratio(a, b, key):
        """The paired ratio of `key` between rows a and b, or None when either lacks it."""
        if key in wrk.get(a, {}) and key in wrk.get(b, {}):
            return paired(wrk[a], wrk[b], lambda p, q: p[key] / q[key])
        return None

    def ratio_row(name, a, b, need, what):
        if r := ratio(a, b, "rps"):
            x, each = r
            per = f"; per round {' / '.join(f'{v:.2f}' for v in each)}" if each else ""
            t.append(f"| {what} ≥ {need}× | {x:.2f}× ({fmt_rps(wrk[a]['rps'])} vs {fmt_rps(wrk[b]['rps'])}{per}) | {verdict(x >= need)} |")

    def p99_row(a, b, what):
        if a in wrk and b in wrk and "p99_ms" in wrk[a] and "p99_ms" in wrk[b]:
            pa, pb = wrk[a]["p99_ms"], wrk[b]["p99_ms"]
            d, each = paired(wrk[a], wrk[b], lambda p, q: p["p99_ms"] - q["p99_ms"])
            per = f"; per round {' / '.join(f'{v:+.2f}' for v in each)}" if each else ""
            t.append(f"| {what} p99 ≤ nginx + 0.3 ms | {pa:.2f} ms vs {pb:.2f} ms ({d:+.2f}{per}) | {verdict(d <= 0.3)} |")

    ratio_row("get", "idemproxy-get", "nginx-get", 1.0, "pass-through GET throughput vs nginx")
    p99_row("idemproxy-get", "nginx-get", "pass-through GET")
    ratio_row("post", "idemproxy-post", "nginx-post", 1.0, "pass-through POST throughput vs nginx")
    p99_row("idemproxy-post", "nginx-post", "pass-through POST")
    ratio_row("replay", "replay-post", "nginx-post", 1.5, "replays vs nginx pass-through (same POST)")
    def info_row(a, b, what, key, figures):
        """A row with no target: the paired ratio of `key` between rows a and b, then
        `figures(a_row, b_row)` (empty for the ratio alone)."""
        if r := ratio(a, b, key):
            x, each = r
            shown = figures(wrk[a], wrk[b])
            if shown and each and key == "rps":
                shown += f"; per round {' / '.join(f'{v:.2f}' for v in each)}"
            t.append(f"| (for information) {what} | {x:.2f}×{f' ({shown})' if shown else ''} | no target |")

    def cpu(p, q):
        return f"{p['cpu_us_per_req']:.1f} vs {q['cpu_us_per_req']:.1f} µs"

    def rps(p, q):
        return f"{fmt_rps(p['rps'])} vs {fmt_rps(q['rps'])}"

    for a, b, what in (("idemproxy-get", "nginx-get", "pass-through GET"),
                       ("idemproxy-post", "nginx-post", "pass-through POST"),
                       ("replay-post", "nginx-post", "replays vs nginx POST pass-through")):
        info_row(a, b, f"server CPU per request, {what}", "cpu_us_per_req", cpu)
    # The same targets for bare hyper: how much of each is left once idemproxy's own work
    # is taken away (benches/hyper_floor.rs), and how far idemproxy is from it.
    for a, b, what in (("floor-get", "nginx-get", "bare hyper proxy vs nginx, GET"),
                       ("floor-post", "nginx-post", "bare hyper proxy vs nginx, POST"),
                       ("floor-static-post", "nginx-post", "bare hyper static answer vs nginx POST pass-through"),
                       ("bare-get", "nginx-get", "hand-written proxy (no hyper) vs nginx, GET"),
                       ("bare-post", "nginx-post", "hand-written proxy (no hyper) vs nginx, POST"),
                       ("bare-static-post", "nginx-post", "hand-written static answer (no hyper) vs nginx POST pass-through")):
        info_row(a, b, what, "rps", rps)
    for a, b, what in (("idemproxy-get", "floor-get", "idemproxy pass-through vs bare hyper proxy, GET"),
                       ("idemproxy-post", "floor-post", "idemproxy pass-through vs bare hyper proxy, POST"),
                       ("replay-post", "floor-static-post", "idemproxy replays vs bare hyper static answer")):
        info_row(a, b, what, "rps", lambda p, q: "")
    if "nocache-replay-post" in wrk and "nginx-post" in wrk and "rps" in wrk["nocache-replay-post"]:
        x = wrk["nocache-replay-post"]["rps"] / wrk["nginx-post"]["rps"]
        t.append(f"| (for information) replays with the replay cache off vs nginx pass-through | {x:.2f}× "
                 f"({fmt_rps(wrk['nocache-replay-post']['rps'])} vs {fmt_rps(wrk['nginx-post']['rps'])}) | no target |")
    first = next((wrk[n] for n in wrk if n == "first-post-c64"), None)
    if first and base and "rps" in first:
        x = first["rps"] / base["executions_per_s"]
        t.append(f"| first executions, 64 clients, vs one commit per write (mean of before/after) ≥ 4× | {x:.1f}× "
                 f"({fmt_rps(first['rps'])} vs {fmt_rps(base['executions_per_s'])} executions/s) | {verdict(x >= 4)} |")
    what = {"get": "read-only pass-through GET", "replay": "replays", "first": "first executions"}
    for name, r in rss.items():
        mib = r["vmhwm_kib"] / 1024
        if name in what:
            t.append(f"| peak RSS with {r['conns']} connections, {what[name]}, ≤ 64 MiB | {mib:.1f} MiB (VmHWM) | {verdict(mib <= 64)} |")
        else:
            t.append(f"| peak RSS of the proxy over the {CONNS_MAIN}-connection rows (≤ 64 MiB) | {mib:.1f} MiB (VmHWM) | {verdict(mib <= 64)} |")
    if len(scale) >= 2 and all("p99_ms" in r for _, r in scale):
        lo, hi = scale[0], scale[-1]
        x = hi[1]["p99_ms"] / max(lo[1]["p99_ms"], 1e-9)
        worst = max(r["p99_ms"] for _, r in scale)
        best = min(r["p99_ms"] for _, r in scale)
        flat = x <= 1.5
        t.append(f"| replay p99 flat from {lo[0]:,} to {hi[0]:,} records (last / first ≤ 1.5) | "
                 f"{lo[1]['p99_ms']:.2f} → {hi[1]['p99_ms']:.2f} ms ({x:.2f}×; range {best:.2f}–{worst:.2f}) | {verdict(flat)} |")
    if churn:
        live = max(churn["live_bytes"], 1)
        x = churn["max_file_bytes"] / live
        y = churn["file_after_restart"] / live
        t.append(f"| file under churn within the stated multiple of live data (10× while running, 5× after a restart; docs/PERFORMANCE.md) | "
                 f"largest {x:.1f}× live while running, {y:.1f}× after a restart | {verdict(x <= 10 and y <= 5)} |")
    out += ["Targets (ratios within this run):", ""] + t + [""]
    return out


def render(a):
    rows = [json.loads(l) for l in open(a.results) if l.strip()]
    machine = next((r for r in rows if r["kind"] == "machine"), {})
    out = [BEGIN, ""]
    if machine:
        out += [f"Machine: {machine['nproc']} cores ({machine['cpu']}), Linux {machine['kernel']}, "
                f"load average at start {' '.join(machine['loadavg'])}; {machine['nginx']}; "
                f"client `{machine['wrk']}` unless the row says otherwise, the same Lua request "
                f"generator for every row (benches/wrk/request.lua).", ""]
    if a.command:
        out += [f"Command: `{a.command}`", ""]
    runs = sorted({r["run"] for r in rows if "run" in r})
    for run in runs:
        out += render_run(run, [r for r in rows if r.get("run") == run])
    out.append(END)
    text = "\n".join(out) + "\n"
    if not a.doc:
        sys.stdout.write(text)
        return
    try:
        doc = open(a.doc).read()
    except FileNotFoundError:
        doc = "# Performance\n\n" + BEGIN + "\n" + END + "\n"
    if BEGIN not in doc or END not in doc:
        doc = doc.rstrip("\n") + "\n\n" + BEGIN + "\n" + END + "\n"
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    open(a.doc, "w").write(head + text.rstrip("\n") + tail)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("parse-wrk")
    for f in ("--group", "--name", "--method"):
        w.add_argument(f, required=True)
    w.add_argument("--run", type=int, required=True)
    w.add_argument("--conns", type=int, required=True)
    w.add_argument("--rep", type=int, default=1)
    w.add_argument("--cpu-ticks", type=int)
    w.add_argument("--clk-tck", type=int, default=100)
    r = sub.add_parser("render")
    r.add_argument("--results", required=True)
    r.add_argument("--doc")
    r.add_argument("--command")
    a = p.parse_args()
    parse_wrk(a) if a.cmd == "parse-wrk" else render(a)


if __name__ == "__main__":
    main()
