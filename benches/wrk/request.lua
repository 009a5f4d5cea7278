-- One request generator for every scenario, so the client does the same work per
-- request whatever is measured (a scenario without keys still goes through request()).
-- Requests are pre-formatted; only the Idempotency-Key changes per request.
--
-- Environment:
--   BENCH_METHOD  GET | POST                      (default GET)
--   BENCH_PATH    path and query                  (default /)
--   BENCH_BODY    JSON body size in bytes, POST   (default 0)
--   BENCH_KEYS    none | unique | pool            (default none)
--   BENCH_POOL    pool mode: keys are PREFIX-1 .. PREFIX-POOL, picked at random
--   BENCH_PREFIX  key prefix; unique mode makes PREFIX-THREAD-N (fresh per run)

local method = os.getenv("BENCH_METHOD") or "GET"
local path = os.getenv("BENCH_PATH") or "/"
local body_bytes = tonumber(os.getenv("BENCH_BODY") or "0")
local keys = os.getenv("BENCH_KEYS") or "none"
local pool = tonumber(os.getenv("BENCH_POOL") or "1000")
local prefix = os.getenv("BENCH_PREFIX") or "k"

-- The same 512-byte (or BENCH_BODY-byte) JSON document in every POST scenario.
local function json_body(n)
  local head = '{"to":"user@example.com","subject":"bench","text":"'
  local tail = '"}'
  local pad = n - #head - #tail
  if pad < 0 then pad = 0 end
  return head .. string.rep("x", pad) .. tail
end

local threads = {}
local counter = 0
local tid = 0
local before, after

function setup(thread)
  thread:set("tid", #threads + 1)
  table.insert(threads, thread)
end

function init(args)
  tid = tonumber(wrk.thread:get("tid")) or 0
  math.randomseed(os.time() + tid * 7919)
  local body = nil
  local headers = { ["Host"] = wrk.host .. ":" .. wrk.port }
  if method == "POST" then
    body = json_body(body_bytes)
    headers["Content-Type"] = "application/json"
  end
  if keys == "none" then
    before = wrk.format(method, path, headers, body)
  else
    -- Split the formatted request around a marker so each request is two concatenations.
    headers["Idempotency-Key"] = "@@KEY@@"
    local whole = wrk.format(method, path, headers, body)
    local i, j = string.find(whole, "@@KEY@@", 1, true)
    before = string.sub(whole, 1, i - 1)
    after = string.sub(whole, j + 1)
  end
end

function request()
  if keys == "none" then
    return before
  end
  counter = counter + 1
  if keys == "unique" then
    return before .. prefix .. "-" .. tid .. "-" .. counter .. after
  end
  return before .. prefix .. "-" .. math.random(1, pool) .. after
end

-- Exact figures for benches/report.py (wrk's own summary rounds them). response() is not
-- defined: wrk counts non-2xx answers itself, and a response hook costs per response.
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "BENCH_RESULT requests=%d duration_us=%d p50_us=%d p90_us=%d p99_us=%d max_us=%d " ..
    "connect=%d read=%d write=%d status=%d timeout=%d\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max, e.connect, e.read, e.write, e.status, e.timeout))
end
