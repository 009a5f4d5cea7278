// idemproxy operator console. Plain browser JavaScript, no build step, no dependencies.
// Every value that came from an agent (previews, paths, notes) is shown with textContent,
// never parsed as HTML. The admin token lives in sessionStorage (this tab only).
"use strict";

const TOKEN_KEY = "idemproxy.admin.token";
const NAME_KEY = "idemproxy.admin.operator";
const REFRESH_MS = 5000;
const PAGE = 50;

const $ = (id) => document.getElementById(id);

const state = {
  limits: { approvals: PAGE, unknown: PAGE, jobs: PAGE },
  timer: null,
  busy: false,
  executionsNext: null,
};

// ---- API ---------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, problem) {
    super((problem && (problem.detail || problem.title)) || `HTTP ${status}`);
    this.status = status;
    this.problem = problem;
  }
}

async function api(method, path, body) {
  const headers = { Authorization: `Bearer ${sessionStorage.getItem(TOKEN_KEY) || ""}` };
  const init = { method, headers, cache: "no-store" };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const resp = await fetch(path, init);
  const text = await resp.text();
  let data = null;
  if (text && (resp.headers.get("content-type") || "").includes("json")) {
    try { data = JSON.parse(text); } catch (_) { data = null; }
  }
  if (resp.status === 401) {
    signOut("The admin token was refused. Paste it again.");
    throw new ApiError(401, data);
  }
  if (!resp.ok) throw new ApiError(resp.status, data);
  return data === null ? text : data;
}

function operator() {
  return sessionStorage.getItem(NAME_KEY) || "console";
}

// ---- small DOM helpers -------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else if (k === "onclick") node.addEventListener("click", v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function ago(ms) {
  if (!ms) return "";
  const s = Math.max(0, Math.round((Date.now() - ms) / 1000));
  if (s < 60) return `${s} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return new Date(ms).toLocaleString();
}

function when(ms) {
  return el("time", { datetime: new Date(ms).toISOString(), title: new Date(ms).toLocaleString() }, ago(ms));
}

function show(value) {
  if (value === null || value === undefined) return "—";
  return typeof value === "string" ? value : JSON.stringify(value);
}

function say(text, kind) {
  const box = $("message");
  box.textContent = text;
  box.className = kind || "ok";
  box.hidden = false;
  clearTimeout(say.timer);
  say.timer = setTimeout(() => { box.hidden = true; }, 8000);
}

function failed(what, err) {
  if (err instanceof ApiError && err.status === 401) return;
  say(`${what} failed: ${err.message}`, "error");
}

// ---- record cards ------------------------------------------------------------------

function previewList(preview) {
  if (!preview || typeof preview !== "object" || Object.keys(preview).length === 0) {
    return el("p", { class: "muted" }, "No preview configured for this route.");
  }
  const dl = el("dl", { class: "preview" });
  for (const [pointer, value] of Object.entries(preview)) {
    dl.append(el("dt", {}, pointer), el("dd", {}, show(value)));
  }
  return dl;
}

function facts(r) {
  return el("p", { class: "facts" },
    el("code", {}, `${r.method} ${r.path}`), " · ",
    r.operation_id ? ["operation ", el("code", {}, r.operation_id), " · "] : null,
    "created ", when(r.created_at_ms),
    r.attempts ? ` · sent ${r.attempts}×` : null);
}

function idLine(r) {
  return el("p", { class: "ids" },
    "execution ", el("code", { class: "exec-id" }, r.execution_id),
    " · args ", el("code", { title: r.args_hash }, r.args_hash.slice(0, 12) + "…"));
}

function approvalCard(r) {
  const approve = el("button", {
    type: "button", class: "primary", "data-action": "approve", "data-id": r.execution_id,
    onclick: () => decide(approve, `Approved ${r.execution_id}`, () =>
      api("POST", `/v1/executions/${encodeURIComponent(r.execution_id)}/approve`,
        { args_hash: r.args_hash, by: operator() })),
  }, "Approve");
  const reject = el("button", {
    type: "button", class: "danger", "data-action": "reject", "data-id": r.execution_id,
    onclick: () => {
      if (!confirm(`Reject ${r.route} (${r.execution_id})? It will never be sent.`)) return;
      decide(reject, `Rejected ${r.execution_id}`, () =>
        api("POST", `/v1/executions/${encodeURIComponent(r.execution_id)}/reject`, { by: operator() }));
    },
  }, "Reject");
  return el("article", { class: "card", "data-id": r.execution_id },
    el("h3", {}, `${r.upstream} / ${r.route}`),
    facts(r), previewList(r.preview), idLine(r),
    r.note ? el("p", { class: "note" }, r.note) : null,
    el("div", { class: "actions" }, approve, reject));
}

function unknownCard(r) {
  const resolve = (as, label) => {
    const b = el("button", {
      type: "button", class: as === "committed" ? "primary" : "", "data-action": `resolve-${as}`,
      "data-id": r.execution_id,
      onclick: () => {
        const q = as === "committed"
          ? `Mark ${r.execution_id} as committed? Retries will get a stored answer and nothing is sent again.`
          : `Mark ${r.execution_id} as not committed? The next retry may send the call again.`;
        if (!confirm(q)) return;
        decide(b, `Resolved ${r.execution_id} as ${as.replace("_", " ")}`, () =>
          api("POST", `/v1/executions/${encodeURIComponent(r.execution_id)}/resolve`, { as, by: operator() }));
      },
    }, label);
    return b;
  };
  return el("article", { class: "card", "data-id": r.execution_id },
    el("h3", {}, `${r.upstream} / ${r.route}`),
    facts(r), r.preview ? previewList(r.preview) : null, idLine(r),
    r.note ? el("p", { class: "note" }, r.note) : null,
    el("div", { class: "actions" },
      resolve("committed", "It happened: committed"),
      resolve("not_committed", "It did not happen: not committed")));
}

async function decide(button, done, call) {
  button.disabled = true;
  try {
    await call();
    say(done, "ok");
    await refresh();
  } catch (err) {
    failed("The decision", err);
    button.disabled = false;
    await refresh();
  }
}

// ---- sections ----------------------------------------------------------------------

async function loadList(status, key, card, empty) {
  const page = await api("GET", `/v1/executions?status=${status}&limit=${state.limits[key]}`);
  const list = $(`${key}-list`);
  list.replaceChildren(...(page.items.length ? page.items.map(card) : [el("p", { class: "muted" }, empty)]));
  $(`${key}-count`).textContent = page.items.length + (page.next ? "+" : "");
  $(`${key}-more`).hidden = !page.next;
}

function parseMetrics(text) {
  const rows = new Map();
  const row = (l) => {
    const k = `${l.upstream}/${l.route}`;
    if (!rows.has(k)) {
      rows.set(k, { upstream: l.upstream, route: l.route, attempts: 0, replays: 0, duplicates: 0,
        unknown: 0, unprotected: 0, reconciled: {}, sum: 0, count: 0 });
    }
    return rows.get(k);
  };
  for (const line of text.split("\n")) {
    const m = /^(idemproxy_[a-z_]+)\{([^}]*)\}\s+(\S+)/.exec(line);
    if (!m) continue;
    const labels = {};
    for (const [, k, v] of m[2].matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[k] = v;
    if (labels.upstream === undefined || labels.route === undefined) continue;
    const v = Number(m[3]);
    const r = row(labels);
    switch (m[1]) {
      case "idemproxy_attempts_total": r.attempts += v; break;
      case "idemproxy_replays_total": r.replays += v; break;
      case "idemproxy_duplicates_prevented_total": r.duplicates += v; break;
      case "idemproxy_outcome_unknown_total": r.unknown += v; break;
      case "idemproxy_unprotected_total": r.unprotected += v; break;
      case "idemproxy_reconciliations_total":
        r.reconciled[labels.result] = (r.reconciled[labels.result] || 0) + v; break;
      case "idemproxy_upstream_duration_seconds_sum": r.sum += v; break;
      case "idemproxy_upstream_duration_seconds_count": r.count += v; break;
      default: break;
    }
  }
  return [...rows.values()].sort((a, b) => `${a.upstream}/${a.route}`.localeCompare(`${b.upstream}/${b.route}`));
}

async function loadMetrics() {
  const rows = parseMetrics(await api("GET", "/metrics"));
  const body = $("metrics-body");
  if (!rows.length) {
    body.replaceChildren(el("tr", {}, el("td", { colspan: 8, class: "muted" }, "No side-effect traffic yet.")));
    return;
  }
  body.replaceChildren(...rows.map((r) => {
    const rec = Object.entries(r.reconciled).map(([k, v]) => `${k}: ${v}`).join(", ") || "0";
    const mean = r.count ? `${(1000 * r.sum / r.count).toFixed(1)} ms` : "—";
    return el("tr", { "data-route": `${r.upstream}/${r.route}` },
      el("th", {}, `${r.upstream} / ${r.route}`),
      el("td", {}, r.attempts), el("td", {}, r.replays), el("td", {}, r.duplicates),
      el("td", { class: r.unknown ? "warn" : "" }, r.unknown), el("td", {}, rec),
      el("td", {}, r.unprotected), el("td", {}, mean));
  }));
}

function detailView(r) {
  const rows = [
    ["State", el("strong", { class: `state ${r.state}` }, r.state.replaceAll("_", " "))],
    ["Route", `${r.upstream} / ${r.route} (${r.tool_version})`],
    ["Request", `${r.method} ${r.path}${r.query ? "?" + r.query : ""}`],
    ["Operation", r.operation_id || "—"],
    ["Model round", r.model_round || "—"],
    ["Tool call", r.tool_call_id || "—"],
    ["Key", r.key ? el("code", {}, r.key) : "—"],
    ["Arguments hash", el("code", {}, r.args_hash)],
    ["Attempts sent", r.attempts],
    ["Created", when(r.created_at_ms)],
    ["Approval", r.approval ? `by ${r.approval.by}, ${ago(r.approval.at_ms)}${r.approval.expires_at_ms ? `, expires ${new Date(r.approval.expires_at_ms).toLocaleString()}` : ""}` : "—"],
    ["Downstream id", r.external_id || "—"],
    ["Stored answer", r.response ? `HTTP ${r.response.status}` : "—"],
    ["Note", r.note || "—"],
  ];
  if (r.item_of) {
    rows.push(["Batch item", el("span", {}, `item ${r.item_of.index} of `,
      el("a", { href: "#", class: "exec-link", onclick: (ev) => { ev.preventDefault(); search(r.item_of.parent); } }, r.item_of.parent))]);
  }
  const dl = el("dl", { class: "detail" });
  for (const [k, v] of rows) dl.append(el("dt", {}, k), el("dd", {}, v));
  const history = el("table", { class: "history" },
    el("thead", {}, el("tr", {}, el("th", {}, "When"), el("th", {}, "From"), el("th", {}, "Event"), el("th", {}, "To"), el("th", {}, "Note"))),
    el("tbody", {}, r.history.map((h) => el("tr", {},
      el("td", {}, when(h.at_ms)), el("td", {}, h.from), el("td", {}, h.event), el("td", {}, h.to), el("td", {}, h.note || "")))));
  const card = el("article", { class: "card", "data-id": r.execution_id },
    el("h3", {}, r.execution_id), dl,
    r.preview ? [el("h4", {}, "Preview"), previewList(r.preview)] : null,
    r.batch ? [el("h4", {}, "Batch items"), batchView(r.batch)] : null,
    r.response ? [el("h4", {}, "Stored answer"), answerView(r.response)] : null,
    r.job ? [el("h4", {}, "Background job"), jobView(r.job)] : null,
    r.events && r.events.length ? [el("h4", {}, "Webhook events"), eventsView(r.events)] : null,
    el("h4", {}, "History"), history);
  if (r.state === "awaiting_approval") card.append(approvalCard(r).querySelector(".actions"));
  if (r.state === "outcome_unknown") card.append(unknownCard(r).querySelector(".actions"));
  return card;
}

// The job a call started (SPEC 9.2): its state, what ended it, and its final result.
function jobView(job) {
  const dl = el("dl", { class: "detail job" });
  const rows = [
    ["Job id", el("code", {}, job.id)],
    ["Job state", el("strong", { class: `job-state ${job.state}` }, job.state)],
    ["Ended by", job.ended_by ? job.ended_by.replaceAll("_", " ") + (job.event ? ` (${job.event})` : "") : "—"],
    ["Started", when(job.started_at_ms)],
    ["Updated", when(job.updated_at_ms)],
  ];
  for (const [k, v] of rows) dl.append(el("dt", {}, k), el("dd", {}, v));
  return el("div", {}, dl,
    job.result !== undefined ? el("pre", { class: "body json" }, JSON.stringify(job.result, null, 2)) : null);
}

// The webhook events correlated to a call (SPEC 9.1), oldest first.
function eventsView(events) {
  return el("table", { class: "history events" },
    el("thead", {}, el("tr", {}, el("th", {}, "When"), el("th", {}, "Event"), el("th", {}, "Type"),
      el("th", {}, "Says"), el("th", {}, "Route"))),
    el("tbody", {}, events.map((e) => el("tr", {},
      el("td", {}, when(e.at_ms)), el("td", {}, el("code", {}, e.id)), el("td", {}, e.type || "—"),
      el("td", {}, e.verdict + (e.held !== undefined ? " (arrived while executing)" : "")),
      el("td", {}, e.route)))));
}

async function loadJobs() {
  const want = $("jobs-state").value;
  const page = await api("GET", `/v1/jobs?limit=${state.limits.jobs}${want ? `&state=${want}` : ""}`);
  const list = $("jobs-list");
  const rows = page.items.map((j) => el("tr", { "data-id": j.execution_id },
    el("td", {}, el("code", {}, j.job.id)),
    el("td", {}, el("strong", { class: `job-state ${j.job.state}` }, j.job.state)),
    el("td", {}, `${j.upstream} / ${j.route}`),
    el("td", {}, j.job.ended_by ? j.job.ended_by.replaceAll("_", " ") : "—"),
    el("td", {}, ago(j.job.updated_at_ms)),
    el("td", {}, el("button", { type: "button", class: "quiet", "data-open": j.execution_id }, j.execution_id))));
  list.replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { colspan: 6, class: "muted" }, "No jobs."))]));
  for (const b of list.querySelectorAll("button[data-open]")) {
    b.addEventListener("click", () => search(b.dataset.open));
  }
  $("jobs-count").textContent = page.items.length + (page.next ? "+" : "");
  $("jobs-more").hidden = !page.next;
}

// An independent batch's items in order, each with its state and a link to its record
// (docs/BATCHES.md); "not sent" where the batch stopped before the item.
function batchView(b) {
  const summary = el("p", { class: "batch-summary" },
    `${b.committed} committed, ${b.unknown} unknown, ${b.not_sent} not sent`);
  const table = el("table", { class: "batch" },
    el("thead", {}, el("tr", {}, el("th", {}, "#"), el("th", {}, "Execution"), el("th", {}, "State"))),
    el("tbody", {}, b.items.map((i) => el("tr", {},
      el("td", {}, String(i.index)),
      el("td", {}, el("a", { href: "#", class: "exec-link", onclick: (ev) => { ev.preventDefault(); search(i.execution_id); } }, i.execution_id)),
      el("td", {}, i.state ? el("span", { class: `state ${i.state}` }, i.state.replaceAll("_", " ")) : "not sent")))));
  return el("div", { class: "batch-items" }, summary, table);
}

// The stored answer as an operator reads it: status, headers as a table, the body
// decoded (JSON pretty-printed, text as is, anything else its size and a hex preview).
function answerView(resp) {
  const headers = el("table", { class: "headers" },
    el("tbody", {}, resp.headers.map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", {}, v)))));
  let body;
  if (resp.body_encoding === "json") {
    body = el("pre", { class: "body json" }, JSON.stringify(resp.body, null, 2));
  } else if (resp.body_encoding === "text") {
    body = el("pre", { class: "body text" }, resp.body);
  } else {
    const bytes = Uint8Array.from(atob(resp.body), (c) => c.charCodeAt(0));
    const hex = [...bytes.slice(0, 64)].map((b) => b.toString(16).padStart(2, "0")).join(" ");
    body = el("p", { class: "body binary" },
      `${bytes.length} bytes of binary data: `, el("code", {}, hex + (bytes.length > 64 ? " …" : "")));
  }
  return el("div", { class: "answer" }, el("p", {}, `HTTP ${resp.status}`), headers, body);
}

// ---- executions: the filtered list ------------------------------------------------

// The list's filters, as the admin API and this page's address name them.
const FILTERS = ["status", "operation", "tool_call", "key", "upstream", "route", "since", "until"];

// The form's filters as query pairs (times as milliseconds since the epoch).
function filterQuery() {
  const form = $("filter-form");
  const q = new URLSearchParams();
  for (const name of FILTERS) {
    const v = form.elements[name].value.trim();
    if (!v) continue;
    if (name === "since" || name === "until") {
      const ms = new Date(v).getTime();
      if (!Number.isNaN(ms)) q.set(name, String(ms));
    } else {
      q.set(name, v);
    }
  }
  return q;
}

// Fills the form from this page's address (a shared link).
function filtersFromAddress() {
  const q = new URLSearchParams(location.search);
  const form = $("filter-form");
  let any = false;
  for (const name of FILTERS) {
    const v = q.get(name);
    if (v === null) continue;
    any = true;
    if (name === "since" || name === "until") {
      const d = new Date(Number(v));
      if (Number.isNaN(d.getTime())) continue;
      // datetime-local reads local time without a zone.
      form.elements[name].value = new Date(d.getTime() - d.getTimezoneOffset() * 60000).toISOString().slice(0, 19);
    } else {
      form.elements[name].value = v;
    }
  }
  return any;
}

async function loadExecutions(after) {
  const q = filterQuery();
  // The address keeps the filters (not the page): a link opens the first page.
  history.replaceState(null, "", q.toString() ? `?${q}` : location.pathname);
  q.set("limit", String(PAGE));
  if (after) q.set("after", after);
  const out = $("executions-result");
  try {
    const page = await api("GET", `/v1/executions?${q}`);
    state.executionsNext = page.next || null;
    $("executions-more").hidden = !page.next;
    if (!page.items.length) {
      out.replaceChildren(el("p", { class: "muted" }, after ? "No more executions." : "No execution matches."));
      return;
    }
    // Pages follow the execution id (a stable cursor); within a page, newest first.
    const items = [...page.items].sort((a, b) => b.created_at_ms - a.created_at_ms);
    const rows = items.map((r) => {
      const open = el("button", { type: "button", class: "link" }, r.execution_id);
      open.addEventListener("click", () => { $("search-id").value = r.execution_id; search(r.execution_id); });
      return el("tr", { "data-id": r.execution_id },
        el("td", {}, when(r.created_at_ms)), el("td", {}, `${r.upstream} / ${r.route}`),
        el("td", {}, el("span", { class: `state ${r.state}` }, r.state.replaceAll("_", " "))),
        el("td", {}, r.operation_id || "—"), el("td", {}, r.tool_call_id || "—"),
        el("td", {}, r.response_status ?? "—"), el("td", {}, open));
    });
    out.replaceChildren(el("table", { class: "executions" },
      el("thead", {}, el("tr", {}, el("th", {}, "When"), el("th", {}, "Route"), el("th", {}, "State"),
        el("th", {}, "Operation"), el("th", {}, "Tool call"), el("th", {}, "Answer"), el("th", {}, "Execution"))),
      el("tbody", {}, rows)));
  } catch (err) {
    if (err instanceof ApiError && err.status === 400) {
      out.replaceChildren(el("p", { class: "error" }, err.message));
    } else {
      failed("The list", err);
    }
  }
}

async function timeline(op) {
  const out = $("timeline-result");
  try {
    const t = await api("GET", `/v1/operations/${encodeURIComponent(op)}`);
    if (!t.executions.length) {
      out.replaceChildren(el("p", { class: "muted" }, `No calls of operation ${op}.`));
      return;
    }
    const rows = t.executions.map((r) => {
      const open = el("button", { type: "button", class: "link" }, r.execution_id);
      open.addEventListener("click", () => { $("search-id").value = r.execution_id; search(r.execution_id); });
      return el("tr", { "data-id": r.execution_id },
        el("td", {}, when(r.created_at_ms)), el("td", {}, `${r.upstream} / ${r.route}`),
        el("td", {}, el("span", { class: `state ${r.state}` }, r.state.replaceAll("_", " "))),
        el("td", {}, r.response_status ?? "—"), el("td", {}, open));
    });
    out.replaceChildren(
      el("p", {}, `Operation ${op}: ${t.state.replaceAll("_", " ")}${t.truncated ? " (first calls only)" : ""}`),
      el("table", { class: "timeline" },
        el("thead", {}, el("tr", {}, el("th", {}, "When"), el("th", {}, "Route"), el("th", {}, "State"),
          el("th", {}, "Answer"), el("th", {}, "Execution"))),
        el("tbody", {}, rows)));
  } catch (err) {
    failed("The timeline", err);
  }
}

async function search(id) {
  const out = $("detail");
  try {
    const r = await api("GET", `/v1/executions/${encodeURIComponent(id)}`);
    out.replaceChildren(detailView(r));
  } catch (err) {
    if (err instanceof ApiError && err.status === 404) {
      out.replaceChildren(el("p", { class: "muted" }, `No execution ${id}.`));
    } else {
      failed("The search", err);
    }
  }
}

async function cancelOperation(op) {
  if (!confirm(`Cancel operation ${op}? Calls not yet sent will never be sent.`)) return;
  try {
    const r = await api("POST", `/v1/operations/${encodeURIComponent(op)}/cancel`, { by: operator() });
    const list = (label, ids) => ids.length ? el("li", {}, `${label}: `, ids.map((id) => el("code", {}, id + " "))) : null;
    $("cancel-result").replaceChildren(el("div", { class: "card" },
      el("p", {}, "Operation ", el("code", {}, op), " is now ", el("strong", {}, r.state.replaceAll("_", " ")), "."),
      el("ul", {},
        list("Cancelled before sending", r.cancelled),
        list("Already committed (left as is)", r.committed),
        list("Sent, outcome not known yet", r.in_doubt.map((x) => `${x.execution_id} (${x.state})`)),
        r.cancelled.length + r.committed.length + r.in_doubt.length === 0
          ? el("li", {}, "No pending calls; later calls of this operation will be refused.") : null)));
    await refresh();
  } catch (err) {
    failed("Cancelling", err);
  }
}

// ---- refresh, sign in / out --------------------------------------------------------

async function refresh() {
  if (state.busy || !sessionStorage.getItem(TOKEN_KEY)) return;
  state.busy = true;
  try {
    await Promise.all([
      loadList("awaiting_approval", "approvals", approvalCard, "Nothing is waiting for approval."),
      loadList("outcome_unknown", "unknown", unknownCard, "No call has an unknown outcome."),
      loadJobs(),
      loadMetrics(),
    ]);
    $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    failed("Loading", err);
  } finally {
    state.busy = false;
  }
}

function signedIn() {
  $("login").hidden = true;
  $("app").hidden = false;
  $("session").hidden = false;
  $("whoami").textContent = `signed in as ${operator()}`;
  refresh();
  loadExecutions();
  clearInterval(state.timer);
  state.timer = setInterval(refresh, REFRESH_MS);
}

function signOut(why) {
  sessionStorage.removeItem(TOKEN_KEY);
  clearInterval(state.timer);
  $("app").hidden = true;
  $("session").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = why || "";
  $("token").value = "";
  $("token").focus();
}

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
    const name = $("operator").value.trim();
    if (name) sessionStorage.setItem(NAME_KEY, name);
    try {
      await api("GET", "/v1/executions?limit=1");
      $("login-error").textContent = "";
      signedIn();
    } catch (err) {
      if (!(err instanceof ApiError && err.status === 401)) {
        $("login-error").textContent = `Could not reach the admin API: ${err.message}`;
      }
    }
  });
  $("signout").addEventListener("click", () => signOut(""));
  $("refresh").addEventListener("click", refresh);
  $("search-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    search($("search-id").value.trim());
  });
  $("timeline-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    timeline($("timeline-op").value.trim());
  });
  $("cancel-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    cancelOperation($("cancel-op").value.trim());
  });
  $("jobs-state").addEventListener("change", refresh);
  $("filter-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    loadExecutions();
  });
  $("filter-clear").addEventListener("click", () => {
    $("filter-form").reset();
    loadExecutions();
  });
  $("executions-more").addEventListener("click", () => loadExecutions(state.executionsNext));
  filtersFromAddress();
  for (const key of ["approvals", "unknown", "jobs"]) {
    $(`${key}-more`).addEventListener("click", () => { state.limits[key] = Math.min(500, state.limits[key] + PAGE); refresh(); });
  }
  if (sessionStorage.getItem(TOKEN_KEY)) signedIn();
  else signOut("");
});
