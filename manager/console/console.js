// The live console: it reads the API every two seconds and acts through it. No build step; no
// data ever goes into innerHTML (textContent only), names are direction-isolated in <bdi>. The
// API token is kept in this tab's sessionStorage and sent as a bearer header: no cookie.
"use strict";

const REFRESH_MS = 2000;
const PAGE = 50;
const NAME_MAX = 40;  // characters of a name shown in a list; the whole name is its title
const KEY = "orch-token";
const SVG = "http://www.w3.org/2000/svg";
const BIDI = /[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]/g;  // direction controls
const state = {
  who: null, timer: null, busy: false, again: false, services: new Map(), kinds: [],
  lists: {}, skew: 0,
  // The live refresh paused by the operator (an action or a click on a page still refreshes).
  paused: false,
  // The activity charts' range in minutes, and the last answer for a long one (read again
  // once a minute: a day of history is not read every two seconds).
  minutes: 30, activity: null,
  // The observer whose params are being edited (the refresh keeps its editor open).
  editing: null,
};
/** The activity ranges offered, in minutes, and the longest a chart's column may stand for. */
const RANGES = [[30, "30 min"], [360, "6 h"], [1440, "24 h"]];
const COLUMNS_MAX = 60;
const $ = (sel) => document.querySelector(sel);
const $$ = (sel) => Array.from(document.querySelectorAll(sel));

// ------------------------------------------------------------------------------ the API
class ApiError extends Error {
  constructor(status, problem) {
    super(`${status} ${problem?.title ?? ""}: ${problem?.detail ?? ""}`);
    this.status = status;
    this.problem = problem || { title: "Error", status, detail: "no problem document" };
  }
}

function token() { return sessionStorage.getItem(KEY) || ""; }

async function api(method, path, params, json, bearer) {
  const url = new URL(path, window.location.origin);
  for (const [k, v] of Object.entries(params || {})) if (v !== "" && v != null) url.searchParams.set(k, v);
  const headers = { Accept: "application/json" };
  const t = bearer ?? token();
  if (t) headers.Authorization = `Bearer ${t}`;
  const init = { method, headers };
  if (json !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(json);
  }
  let r;
  try { r = await fetch(url, init); } catch (err) {
    throw new ApiError(0, { title: "Network error", status: 0, detail: String(err.message || err) });
  }
  const body = r.headers.get("content-type")?.includes("json") ? await r.json() : null;
  if (r.status === 401 && bearer === undefined && state.who) {
    signOut("The manager refused the token (401); sign in again.");
  }
  if (!r.ok) throw new ApiError(r.status, body || { title: r.statusText, status: r.status, detail: "" });
  return body;
}

// ------------------------------------------------------------------------------ small parts
function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text != null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function svg(tag, attrs) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  return e;
}

function td(content) {
  const cell = el("td");
  if (content instanceof Node) cell.append(content); else if (content != null) cell.textContent = String(content);
  return cell;
}

function short(id) { return id ? id.slice(0, 8) : ""; }
function count(n) { return Number(n).toLocaleString("en-US"); }
function admin() { return state.who?.role === "admin"; }

/** A name, safely: text only, direction-isolated, truncated, the whole of it as the title. */
function nameNode(name, href) {
  const shown = name.replace(BIDI, "\uFFFD");  // a control shows as what it is, not as an effect
  const b = el("bdi", shown.length > NAME_MAX ? `${shown.slice(0, NAME_MAX - 1)}…` : shown, "name");
  b.title = name;
  if (!href) return b;
  const a = el("a");
  a.href = href;
  a.append(b);
  return a;
}

// Times: one way everywhere, "2025-01-31 13:04:05 UTC", in the browser's zone, named.
const ZONE = Intl.DateTimeFormat().resolvedOptions().timeZone;
const FMT = new Intl.DateTimeFormat("en-GB", {
  year: "numeric", month: "2-digit", day: "2-digit", hour: "2-digit", minute: "2-digit",
  second: "2-digit", hourCycle: "h23", timeZoneName: "short",
});
function stamp(iso) {
  const p = Object.fromEntries(FMT.formatToParts(new Date(iso)).map((x) => [x.type, x.value]));
  return `${p.year}-${p.month}-${p.day} ${p.hour}:${p.minute}:${p.second} ${p.timeZoneName}`;
}
/** "12 s ago", "in 8 s", "3 min ago", "2.5 h ago", "4 d ago": by the server's clock when a view
 * told it (state.skew), so a browser whose clock is off does not shift them. */
function ago(iso) {
  const s = (Date.now() + state.skew - Date.parse(iso)) / 1000;
  const a = Math.abs(s);
  if (a < 1) return "just now";
  const span = a < 60 ? `${Math.round(a)} s` : a < 3600 ? `${Math.round(a / 60)} min`
    : a < 86400 ? `${(a / 3600).toFixed(a < 36000 ? 1 : 0)} h` : `${Math.round(a / 86400)} d`;
  return s > 0 ? `${span} ago` : `in ${span}`;
}
/** A time as how long ago it was; the absolute time in its title (shown on hover). */
/** Its latest durable progress: a checkpoint, or a commit of emitted records (a kind that emits
 * commits its checkpoint with its records: a websocket feed read "never" while it committed). */
function progress(o) {
  const commit = o.committed_at && (!o.checkpointed_at || o.committed_at > o.checkpointed_at);
  const t = when(commit ? o.committed_at : o.checkpointed_at);
  if (commit) t.classList.add("commit");  // a commit of its records, not a checkpoint
  return t;
}

function when(iso) {
  if (!iso) return el("span", "never", "muted");
  const t = el("time", ago(iso));
  t.dateTime = iso;
  t.title = stamp(iso);
  return t;
}

/** The statuses a restart takes: a failed observer is revived, a running one restarted. */
const RESTARTABLE = new Set(["failed", "processing"]);

/** "restart 3 of 5, next in 12 s": the restart budget and the backoff. */
function restarts(o) {
  if (!o.restart_count) return "";
  let s = `restart ${o.restart_count} of ${o.max_restarts}`;
  if (o.in_backoff) s += `, next in ${Math.max(0, Math.ceil(o.next_restart_in ?? 0))} s`;
  return s;
}

/** Its status, but "backoff" while it waits to be restarted and "waiting" while no live service
 * holds it (queued, or no service able to run it): "processing" only with a live holder. */
function statusPill(o) {
  const shown = o.in_backoff ? "backoff" : o.waiting && LIVE.includes(o.status) ? "waiting" : o.status;
  const p = el("span", shown, `pill status-${shown}`);
  if (o.in_backoff) p.title = `${o.status}: its code raised, it waits to be restarted`;
  else if (shown === "waiting") p.title = `${o.status}: ${o.waiting}`;
  return p;
}
const LIVE = ["created", "processing"];

// ------------------------------------------------------------------------------ problems
/** Every failed action leaves its problem document on the page until it is dismissed. */
function report(what, err, items) {
  const p = err?.problem || { title: "Error", status: "", detail: String(err?.message || err) };
  const box = el("div", null, "problem");
  box.dataset.status = String(p.status ?? "");
  const head = el("div", null, "problem-head");
  head.append(el("strong", `${what}: ${p.status || ""} ${p.title || ""}`.replace(/\s+/g, " ")));
  const x = el("button", "Dismiss", "dismiss");
  x.type = "button";
  x.onclick = () => box.remove();
  head.append(x);
  box.append(head);
  if (p.detail) box.append(el("p", p.detail, "problem-detail"));
  const lines = (p.errors || []).map((e) => `${(e.loc || []).join(".")}: ${e.msg}`);
  for (const it of items || []) lines.push(it);
  if (lines.length) {
    const ul = el("ul");
    ul.append(...lines.map((l) => el("li", l)));
    box.append(ul);
  }
  $("#problems").append(box);
}

/** The items of a bulk answer that failed, as one problem that stays, each named. */
function reportFailed(what, out, byId) {
  const bad = out.items.filter((i) => i.problem);
  if (!bad.length) return;
  report(`${what}: ${bad.length} of ${out.items.length} failed`, { problem: { ...bad[0].problem, detail: "" } },
    bad.map((i) => `${byId?.get(i.id) ?? i.id}: ${i.problem.status} ${i.problem.title}: ${i.problem.detail}`));
}

/** Ask first, in the page (no window.confirm); resolves true on "confirm". */
function ask(question, okLabel, names) {
  const d = $("#confirm");
  $("#confirm-text").textContent = question;
  const list = $("#confirm-list");
  list.replaceChildren(...(names || []).slice(0, 10).map((n) => { const li = el("li"); li.append(nameNode(n)); return li; }));
  if ((names || []).length > 10) list.append(el("li", `and ${names.length - 10} more`, "muted"));
  $("#confirm-ok").textContent = okLabel || "Confirm";
  return new Promise((resolve) => {
    const done = (v) => { d.close(); $("#confirm-ok").onclick = null; $("#confirm-cancel").onclick = null; resolve(v); };
    $("#confirm-ok").onclick = () => done(true);
    $("#confirm-cancel").onclick = () => done(false);
    d.oncancel = () => done(false);
    d.showModal();
  });
}

async function act(what, method, path, question, okLabel, names) {
  if (question && !(await ask(question, okLabel, names))) return;
  try { await api(method, path); } catch (err) { report(what, err); }
  await refresh();
}

// ------------------------------------------------------------------------------ signing in
async function start() {
  $("#zone").textContent = `times in ${ZONE}`;
  $("#login-form").addEventListener("submit", signIn);
  $("#logout").onclick = () => signOut("Signed out.");
  $("#filters").addEventListener("submit", (e) => e.preventDefault());
  let debounce = null;
  $("#filters").addEventListener("input", () => {
    filtersToUrl();
    clearTimeout(debounce);
    debounce = setTimeout(() => { state.lists.observers.offset = 0; refresh(); }, 250);
  });
  filtersFromUrl();
  $("#a-filter").addEventListener("submit", (e) => e.preventDefault());
  $("#a-filter").addEventListener("input", () => { clearTimeout(debounce); debounce = setTimeout(refresh, 250); });
  $("#create-go").onclick = createMany;
  $("#pause").onclick = togglePause;
  showRanges();
  for (const b of $$("#bulk button")) b.onclick = () => bulkOverview(b.dataset.verb);
  $("#bulk-pool").onchange = () => state.lists.observers.changed();
  $("#bulk-every").onchange = () => state.lists.observers.changed();
  $("#f-restart").onclick = () => bulk("restart");
  $("#f-delete").onclick = () => bulk("delete");
  $("#f-every").onchange = () => state.lists.failed.changed();
  window.addEventListener("hashchange", () => { window.scrollTo(0, 0); filtersFromUrl(); refresh(); });
  makeLists();
  try {
    signedIn(await api("GET", "/whoami", null, undefined, token()));
  } catch (err) {
    showLogin(token() && err.status === 401 ? "That API token was refused." : "");
  }
}

function showLogin(message) {
  clearInterval(state.timer);
  state.timer = null;
  $("#login").hidden = false;
  for (const s of Object.keys(RENDER)) $(`#${s}`).hidden = true;
  for (const s of ["#nav", "#whoami", "#logout", "#pause"]) $(s).hidden = true;
  const e = $("#login-error");
  e.hidden = !message;
  e.textContent = message || "";
  $("#login-token").value = "";
  $("#login-token").focus();
}

async function signIn(event) {
  event.preventDefault();
  const t = $("#login-token").value.trim();
  if (!t) return;
  $("#login-go").disabled = true;
  try {
    const who = await api("GET", "/whoami", null, undefined, t);
    sessionStorage.setItem(KEY, t);
    signedIn(who);
  } catch (err) {
    showLogin(err.status === 401 ? "That API token was refused." : `${err.problem.title}: ${err.problem.detail}`);
  } finally {
    $("#login-go").disabled = false;
  }
}

function signOut(message) {
  sessionStorage.removeItem(KEY);
  state.who = null;
  state.kinds = [];
  for (const t of $$("table.observers, #services tbody, #o-events tbody")) t.replaceChildren();
  for (const f of ["#activity", "#s-activity", "#totals"]) $(f).replaceChildren();
  $("#leader").textContent = "";
  $("#updated").textContent = "";
  showLogin(message);
}

async function signedIn(who) {
  state.who = who;
  $("#login").hidden = true;
  $("#nav").hidden = false;
  $("#whoami").hidden = false;
  $("#pause").hidden = false;
  $("#logout").hidden = !who.auth;
  $("#who-name").textContent = who.name;
  $("#who-role").textContent = who.role;
  $("#who-role").className = `role role-${who.role}`;
  for (const e of $$("[data-admin]")) e.hidden = !admin();
  for (const list of Object.values(state.lists)) { list.all = null; list.selected.clear(); list.head(); }
  // The last `orch verify` report, when this manager has one (ORCH_VERIFY_REPORT).
  fetch("/verify-report", { method: "HEAD" })
    .then((r) => { $("#verify-report").hidden = !r.ok; })
    .catch(() => {});
  // Kinds once signed in (before, the API would refuse them).
  try {
    const [kinds, pools] = await Promise.all([api("GET", "/kinds"), api("GET", "/pools")]);
    state.kinds = kinds;
    const choices = [["kind", kinds.map((k) => k.name)], ["pool", pools.map((p) => p.name)]];
    for (const [name, values] of choices) {
      const select = $(`#filters select[name=${name}]`);
      select.replaceChildren(el("option", "any"), ...values.map((v) => el("option", v)));
      select.options[0].value = "";
    }
    const target = $("#bulk-pool");
    target.replaceChildren(el("option", "choose"), ...pools.map((p) => el("option", p.name)));
    target.options[0].value = "";
    filtersFromUrl();  // a kind or pool named in the address can be chosen only now
  } catch (err) { report("Loading the kinds", err); }
  clearInterval(state.timer);
  state.timer = setInterval(() => { if (!state.paused) refresh(); }, REFRESH_MS);
  await refresh();
}

// ------------------------------------------------------------------------------ lists
const COLUMNS = {
  name: { label: "name", sort: "name", cell: (o) => nameNode(o.name, `#/observers/${o.id}`) },
  kind: { label: "kind", sort: "kind", cell: (o) => o.kind },
  pool: { label: "pool", sort: "pool", cell: (o) => o.pool },
  status: { label: "status", sort: "status", cell: statusPill },
  service: {
    label: "service", sort: "service",
    cell: (o) => o.waiting && LIVE.includes(o.status) ? Object.assign(el("span", "none", "muted"), { title: o.waiting })
      : o.service_id ? nameNode(o.service_name || short(o.service_id), `#/services/${o.service_id}`) : "",
  },
  epoch: { label: "epoch", sort: "epoch", cell: (o) => o.epoch },
  restarts: { label: "restarts", sort: "restarts", cell: (o) => el("span", restarts(o), o.in_backoff ? "restarts backoff" : "restarts") },
  checkpoint: { label: "last checkpoint", sort: "checkpoint", cell: (o) => progress(o) },
  created: { label: "created", sort: "created", cell: (o) => when(o.created_at) },
  error: {
    label: "last error",
    cell: (o) => { const s = el("span", (o.last_error || "").slice(0, 80), "error-text"); s.title = o.last_error || ""; return s; },
  },
};

class List {
  constructor(id, columns, params, { selectable = false, sort = "created", order = "asc" } = {}) {
    Object.assign(this, { id, columns, params, selectable, sort, order, offset: 0, page: null });
    this.table = $(`#${id}`);
    this.pager = $(`[data-pager="${id}"]`);
    this.selected = new Set();
    this.prev = el("button", "← previous");
    this.next = el("button", "next →");
    this.range = el("span", "", "muted range");
    for (const b of [this.prev, this.next]) b.type = "button";
    this.prev.onclick = () => { this.offset = Math.max(0, this.offset - PAGE); refresh(); };
    this.next.onclick = () => { if (this.page?.next_offset != null) { this.offset = this.page.next_offset; refresh(); } };
    this.pager.append(this.prev, this.range, this.next);
    this.head();
  }

  head() {
    const tr = el("tr");
    if (this.selectable && admin()) {
      this.all = el("input");
      this.all.type = "checkbox";
      this.all.setAttribute("aria-label", "select every observer on this page");
      this.all.onchange = () => {
        for (const o of this.page?.items || []) this.all.checked ? this.selected.add(o.id) : this.selected.delete(o.id);
        this.render(this.page);
      };
      tr.append(td(this.all));
    }
    for (const key of this.columns) {
      const c = COLUMNS[key];
      const th = el("th");
      th.dataset.col = key;
      if (c.sort) {
        const b = el("button", c.label, "sort");
        b.type = "button";
        b.dataset.sort = c.sort;
        b.onclick = () => {
          this.order = this.sort === c.sort && this.order === "asc" ? "desc" : "asc";
          this.sort = c.sort;
          this.offset = 0;
          refresh();
        };
        th.append(b);
      } else th.textContent = c.label;
      tr.append(th);
    }
    const thead = el("thead");
    thead.append(tr);
    this.table.replaceChildren(thead, el("tbody"));
  }

  async load() {
    const page = await api("GET", "/views/observers", {
      ...this.params(), sort: this.sort, order: this.order, limit: PAGE, offset: this.offset,
    });
    if (page.now) state.skew = Date.parse(page.now) - Date.now();
    if (page.items.length === 0 && this.offset > 0 && page.total > 0) {  // the page emptied
      this.offset = Math.max(0, Math.floor((page.total - 1) / PAGE) * PAGE);
      return this.load();
    }
    this.render(page);
    return page;
  }

  render(page) {
    this.page = page;
    if (this.selectable && admin() && !this.all) this.head();
    const ids = new Set(page.items.map((o) => o.id));
    for (const id of this.selected) if (!ids.has(id)) this.selected.delete(id);
    for (const th of this.table.querySelectorAll("th[data-col]")) {
      const key = COLUMNS[th.dataset.col].sort;
      const on = key && key === this.sort;
      th.setAttribute("aria-sort", on ? (this.order === "asc" ? "ascending" : "descending") : "none");
      th.classList.toggle("sorted", Boolean(on));
      th.classList.toggle("desc", Boolean(on) && this.order === "desc");
    }
    this.table.tBodies[0].replaceChildren(...page.items.map((o) => {
      const tr = el("tr", null, o.status === "failed" ? "failed" : o.in_backoff ? "backoff" : o.restart_count > 0 ? "restarting" : "");
      tr.dataset.id = o.id;
      if (this.selectable && admin()) {
        const box = el("input");
        box.type = "checkbox";
        box.checked = this.selected.has(o.id);
        box.setAttribute("aria-label", `select ${o.name}`);
        box.onchange = () => { box.checked ? this.selected.add(o.id) : this.selected.delete(o.id); this.changed(); };
        tr.append(td(box));
      }
      for (const key of this.columns) {
        const cell = td(COLUMNS[key].cell(o));
        cell.dataset.col = key;
        tr.append(cell);
      }
      return tr;
    }));
    if (page.items.length === 0) {
      const empty = el("tr");
      const cell = td(el("span", "none", "muted"));
      cell.colSpan = this.columns.length + 1;
      empty.append(cell);
      this.table.tBodies[0].append(empty);
    }
    const first = page.items.length ? page.offset + 1 : 0;
    this.range.textContent = `${count(first)}–${count(page.offset + page.items.length)} of ${count(page.total)}`;
    this.prev.disabled = page.offset === 0;
    this.next.disabled = page.next_offset == null;
    this.changed();
  }

  changed() {
    if (this.all) this.all.checked = this.page?.items.length > 0 && this.page.items.every((o) => this.selected.has(o.id));
    if (this.onchange) this.onchange();
  }
}

function makeLists() {
  const filters = () => {
    const f = Object.fromEntries(new FormData($("#filters")));
    return {
      q: f.q?.trim(), status: f.status, kind: f.kind, pool: f.pool, param: f.param?.trim(),
      include_deleted: f.include_deleted ? "true" : "",
    };
  };
  state.lists.observers = new List("observers",
    ["name", "kind", "pool", "status", "service", "epoch", "restarts", "checkpoint", "created"], filters,
    { selectable: true });
  state.lists.observers.onchange = () => {
    const list = state.lists.observers;
    const every = $("#bulk-every").checked;
    const target = everyTarget();
    $("#bulk-every-label").textContent = target.why ? `every one the filters match (${target.why})`
      : `every one the filters match (${count(target.n)})`;
    const n = every ? (target.why ? 0 : target.n) : list.selected.size;
    // Restart revives failed observers and restarts running ones (any other answers 409):
    // offered for those alone.
    const chosen = (list.page?.items || []).filter((o) => list.selected.has(o.id));
    const restartable = every ? RESTARTABLE.has($("#filters select[name=status]").value)
      : chosen.length > 0 && chosen.every((o) => RESTARTABLE.has(o.status));
    for (const b of $$("#bulk button")) {
      b.disabled = n === 0 || (b.dataset.verb === "move" && !$("#bulk-pool").value)
        || (b.dataset.verb === "restart" && !restartable);
      if (b.dataset.verb === "restart") b.title = restartable ? "" : "restart takes failed or running observers: select those";
    }
    if (n && !every) $("#bulk-selected").textContent = `${n} selected`;
  };
  state.lists.service = new List("s-observers",
    ["name", "kind", "status", "epoch", "restarts", "checkpoint"], () => ({ service_id: state.serviceId }),
    { sort: "name" });
  state.lists.failed = new List("f-observers",
    ["name", "kind", "restarts", "error", "checkpoint", "created"], () => ({ status: "failed" }),
    { selectable: true, sort: "name" });
  state.lists.failed.onchange = () => {
    const every = $("#f-every").checked;
    const total = state.lists.failed.page?.total ?? 0;
    const n = every ? total : state.lists.failed.selected.size;
    $("#f-every-label").textContent = `every failed one (${count(total)})`;
    $("#f-restart").disabled = n === 0;
    $("#f-delete").disabled = n === 0;
    $("#f-restart").textContent = every ? "Restart every one" : "Restart selected";
    $("#f-delete").textContent = every ? "Delete every one" : "Delete selected";
    if (n && !every) $("#f-selected").textContent = `${n} selected`;
  };
}

// ------------------------------------------------------------------------------ activity
const SERIES = [["taken", "takes"], ["restarted", "restarts"], ["failed", "failures"]];

/** One chart per series: a column a minute, the y axis from 0 to the peak (labelled), the time
 * axis from the first minute to now (labelled), and the live value: this minute's so far. */
function activity(figure, data) {
  const minutes = data.buckets.length, per = Math.ceil(minutes / COLUMNS_MAX);
  const buckets = [];  // a column stands for `per` minutes (one, for the last 30 minutes)
  for (let i = 0; i < minutes; i += per) {
    const group = data.buckets.slice(i, i + per);
    const column = { at: group[0].at };
    for (const [key] of SERIES) column[key] = group.reduce((sum, b) => sum + b[key], 0);
    buckets.push(column);
  }
  const unit = per === 1 ? "min" : `${per} min`;
  const span = minutes >= 120 ? `${minutes / 60} h` : `${minutes} min`;
  const W = 240, H = 44, L = 24, B = 12, n = buckets.length, bw = W / n;
  figure.replaceChildren(...SERIES.map(([key, label]) => {
    const values = buckets.map((b) => b[key]);
    const max = Math.max(1, ...values);
    const total = values.reduce((a, b) => a + b, 0);
    const box = el("div", null, `spark spark-${key}`);
    const head = el("div", null, "spark-head");
    const now = el("strong", count(values[n - 1] ?? 0), "spark-now");
    now.title = per === 1 ? "this minute so far" : `these ${per} minutes so far`;
    head.append(el("span", `${label} / ${unit}`, "muted"), now);
    const chart = svg("svg", { viewBox: `0 0 ${L + W} ${H + B}`, width: L + W, height: H + B, role: "img", "aria-label": `${label} per ${unit}, the last ${span}` });
    const tick = (x, y, text, anchor, cls) => {
      const t = svg("text", { x, y, "text-anchor": anchor, class: `tick ${cls}` });
      t.textContent = text;
      return t;
    };
    chart.append(
      svg("line", { x1: L, y1: H - 0.5, x2: L + W, y2: H - 0.5, class: "axis" }),
      svg("line", { x1: L - 0.5, y1: 0, x2: L - 0.5, y2: H, class: "axis" }),
      svg("line", { x1: L, y1: 2.5, x2: L + W, y2: 2.5, class: "grid" }),
      tick(L - 3, 8, count(max), "end", "y-max"), tick(L - 3, H, "0", "end", "y-min"),
      tick(L, H + B - 1, `${span} ago`, "start", "x-from"), tick(L + W, H + B - 1, "now", "end", "x-to"),
    );
    buckets.forEach((b, i) => {
      if (!b[key]) return;
      const h = Math.max(2, (b[key] / max) * (H - 3));
      const r = svg("rect", { x: (L + i * bw + 0.5).toFixed(2), y: (H - h).toFixed(2), width: Math.max(1, bw - 1).toFixed(2), height: h.toFixed(2), class: `bar-${key}` });
      const t = svg("title");
      t.textContent = `${stamp(b.at)}: ${b[key]} ${label}`;
      r.append(t);
      chart.append(r);
    });
    box.append(head, chart, el("div", `${count(total)} in ${span} · peak ${count(max === 1 && total === 0 ? 0 : max)}`, "muted small"));
    return box;
  }));
}

// ------------------------------------------------------------------------------ the views
function serviceButtons(s, where) {
  if (!admin() || s.is_deleted) return [];
  const b = s.draining
    ? el("button", "undrain")
    : el("button", "drain", "danger");
  b.type = "button";
  b.dataset.action = s.draining ? "undrain" : "drain";
  b.onclick = s.draining
    ? () => act(`Undrain ${s.name}`, "POST", `/services/${s.id}/undrain`, null)
    : () => act(`Drain ${s.name}`, "POST", `/services/${s.id}/drain`,
      `Drain ${s.name}? Every observer on it moves to the others, and it takes no new ones until it is undrained.`, "Drain");
  b.dataset.where = where;
  return [b];
}

/** Its state; "silent" once it has missed a renewal: its last one is older than half its lease
 * (it renews five times a lease), so it may be dead or frozen, and the sweeper has not yet
 * proven it gone ("taking work" was shown 4 s after a kill -9). */
function serviceState(s) {
  if (s.is_deleted) return "gone";
  const renewed = Date.parse(s.last_heartbeat_at);
  const lease = Date.parse(s.lease_expires_at) - renewed;
  if (Date.now() - renewed > Math.max(lease / 2, 1000)) return "silent";
  return s.draining ? "draining" : "taking work";
}

/** Its memory and its share of one core, as its last renewal reported them. */
function usage(s) {
  const mib = s.rss_bytes == null ? "?" : `${Math.round(s.rss_bytes / 1048576)} MiB`;
  const cpu = s.cpu == null ? "?" : `${Math.round(100 * s.cpu)} %`;
  const u = el("span", `${mib} · ${cpu}`, "usage");
  u.title = "resident memory · share of one core over its last renewal period";
  return u;
}

/** The whole cluster: capacity, used, free and waiting, then every observer by status (a chip
 * filters the list on its status); "shown" counts the list as filtered. */
function totals(cluster, page) {
  const figure = (key, label, value, title) => {
    const c = el("span", null, `chip figure figure-${key}`);
    c.dataset.figure = key;
    c.title = title;
    c.append(el("span", label), el("strong", count(value)));
    return c;
  };
  const capacity = [
    figure("slots", "slots", cluster.slots, `the worker slots of the ${cluster.services} live service(s) taking work`),
    figure("running", "running", cluster.running, "observers live services hold"),
    figure("free", "free", cluster.free, "slots nobody holds"),
    figure("waiting", "waiting", cluster.waiting, "live observers no live service holds: queued for a free slot, no service able to run them, or moving from a service that is gone"),
  ];
  capacity[3].classList.toggle("warn", cluster.waiting > 0);
  const order = ["created", "processing", "pausing", "paused", "on_deleting", "failed", "deleted"];
  const chips = order.map((status) => {
    const b = el("button", null, `chip status-${status}`);
    b.type = "button";
    b.dataset.status = status;
    b.title = `every ${status} observer of the cluster; click to list them`;
    b.append(el("span", status), el("strong", count(cluster.by_status[status] || 0)));
    // "processing 34" beside "running 30, waiting 4" misled: say which of them wait (no live
    // holder: moving from a gone service, or queued again), as the list says of each.
    const waitingHere = Math.max(0, cluster.waiting - (cluster.by_status.created || 0));
    if (status === "processing" && waitingHere) {
      b.append(el("span", `${count(waitingHere)} waiting`, "sub"));
      b.title += `; ${count(waitingHere)} of them have no live holder now (they wait to be taken again)`;
    }
    b.onclick = () => {
      const sel = $("#filters select[name=status]");
      sel.value = sel.value === status ? "" : status;
      filtersToUrl();
      state.lists.observers.offset = 0;
      refresh();
    };
    b.classList.toggle("on", $("#filters select[name=status]").value === status);
    return b;
  });
  const all = el("span", null, "chip total");
  all.title = "observers the list's filters match";
  all.append(el("span", "shown"), el("strong", count(page.total)));
  $("#capacity").replaceChildren(...capacity);
  $("#totals").replaceChildren(all, ...chips);
}

// The broker as the manager sees it (/views/broker): an alarm that blocks publishes shows here.
function broker(node, b) {
  const parts = [!b.connected ? "broker: not connected" : b.blocked ? "broker: publishes blocked (a memory or disk alarm)" : "broker: connected"];
  if (b.ready != null) parts.push(`work queue: ${count(b.ready)} ready, ${count(b.consumers)} consumer(s)`);
  node.textContent = parts.join(" · ");
  node.title = b.blocked ? "New starts wait in the outbox until the alarm ends; failover goes through the database meanwhile." : "";
  node.className = !b.connected || b.blocked ? "warn" : "muted";
}

// What a failover of the database can lose, as the manager last read it (/healthz).
function durability(node, health) {
  const db = health.database || {};
  const mode = db.durability;
  const lag = db.replication_lag_seconds;
  node.textContent = !mode ? "" : mode === "asynchronous" && lag != null
    ? `database: asynchronous (a failover can lose the last ${lag.toFixed(1)} s)`
    : `database: ${mode}`;
  node.title = (health.warnings || []).join("\n");
  node.className = mode === "synchronous" || !mode ? "muted" : "warn";
}

/** The overview's activity for the chosen range: the last 30 minutes read at every refresh, a
 * longer range once a minute. */
async function overviewActivity() {
  const kept = state.activity;
  if (kept && kept.minutes === state.minutes && state.minutes > 30 && Date.now() - kept.read < 60_000) return kept.data;
  const data = await api("GET", "/views/activity", { minutes: state.minutes });
  state.activity = { minutes: state.minutes, read: Date.now(), data };
  return data;
}

function showRanges() {
  $("#range").replaceChildren(...RANGES.map(([minutes, label]) => {
    const b = el("button", label, minutes === state.minutes ? "chip on" : "chip");
    b.type = "button";
    b.dataset.minutes = String(minutes);
    b.setAttribute("aria-pressed", String(minutes === state.minutes));
    b.onclick = () => { state.minutes = minutes; showRanges(); refresh(); };
    return b;
  }));
}

function togglePause() {
  state.paused = !state.paused;
  $("#pause").textContent = state.paused ? "Resume refresh" : "Pause refresh";
  $("#pause").setAttribute("aria-pressed", String(state.paused));
  if (state.paused) $("#updated").textContent = `paused · ${$("#updated").textContent}`;
  else refresh();
}

async function renderOverview() {
  const [services, leader, health, broker_, cluster, act_, page] = await Promise.all([
    api("GET", "/services"),
    api("GET", "/leader"),
    api("GET", "/healthz"),
    api("GET", "/views/broker"),
    api("GET", "/views/totals"),
    overviewActivity(),
    state.lists.observers.load(),
  ]);
  totals(cluster, page);
  const failed = cluster.by_status.failed || 0;
  $("#failed-count").textContent = failed ? count(failed) : "";
  activity($("#activity"), act_);
  state.services = new Map(services.map((s) => [s.id, s]));
  $("#leader").textContent = leader.holder ? `leader: ${leader.holder}` : "no leader";
  durability($("#durability"), health);
  broker($("#broker"), broker_);
  $("#services tbody").replaceChildren(...services.map((s) => {
    const bar = el("span", null, "bar");
    const fill = el("span");
    fill.style.width = `${Math.min(100, (100 * s.running) / Math.max(1, s.worker_count))}%`;
    bar.append(fill);
    const load = el("span");
    load.append(bar, `${s.running} / ${s.worker_count}`);
    const actions = el("span", null, "actions inline");
    actions.append(...serviceButtons(s, "list"));
    const tr = el("tr", null, s.draining ? "draining" : "");
    tr.dataset.id = s.id;
    tr.append(td(nameNode(s.name, `#/services/${s.id}`)), td(el("span", short(s.id), "mono")), td(s.pool), td(load),
      td(el("span", serviceState(s), `pill state-${serviceState(s).replace(" ", "-")}`)), td(when(s.last_heartbeat_at)),
      td(usage(s)), td(actions));
    return tr;
  }));
}

async function renderService(id) {
  state.serviceId = id;
  const [s, act_] = await Promise.all([
    api("GET", `/views/services/${id}`),
    api("GET", "/views/activity", { minutes: 30, service_id: id }),
    state.lists.service.load(),
  ]);
  $("#s-name").textContent = s.name;
  const st = serviceState(s);
  $("#s-state").textContent = st;
  $("#s-state").className = `pill state-${st.replace(" ", "-")}`;
  const fields = [["id", s.id], ["pool", s.pool], ["load", `${s.running} / ${s.worker_count}`], ["host", `${s.host} (pid ${s.pid})`],
    ["version", s.version], ["started", when(s.created_at)], ["last renewal", when(s.last_heartbeat_at)],
    ["usage", usage(s)],
    ["lease until", when(s.lease_expires_at)]];
  $("#s-fields").replaceChildren(...fields.flatMap(([k, v]) => {
    const dd = el("dd");
    dd.id = `s-field-${k.replace(" ", "-")}`;
    if (v instanceof Node) dd.append(v); else dd.textContent = String(v ?? "");
    return [el("dt", k), dd];
  }));
  $("#s-actions").replaceChildren(...serviceButtons(s, "page"));
  activity($("#s-activity"), act_);
}

async function renderFailed() {
  const page = await state.lists.failed.load();
  $("#f-total").textContent = `(${count(page.total)})`;
  $("#failed-count").textContent = page.total ? count(page.total) : "";
}

async function renderActions() {
  const by = $("#a-by").value.trim();
  const query = by ? `?by=${encodeURIComponent(by)}&limit=200` : "?limit=200";
  const rows = await api("GET", `/views/actions${query}`);
  $("#a-actions tbody").replaceChildren(...rows.map((a) => {
    const tr = el("tr");
    tr.append(td(when(a.at)), td(a.actor), td(a.event),
      td(nameNode(a.observer_name, `#/observers/${a.observer_id}`)), td(a.kind), td(a.detail ?? ""));
    return tr;
  }));
}

async function bulk(verb) {
  const list = state.lists.failed;
  if ($("#f-every").checked) return bulkEveryFailed(verb);
  const chosen = (list.page?.items || []).filter((o) => list.selected.has(o.id));
  if (!chosen.length) return;
  const names = chosen.map((o) => o.name);
  const question = verb === "restart"
    ? `Restart ${chosen.length} failed observer(s)? Each starts again from its last checkpoint with a fresh restart budget.`
    : `Delete ${chosen.length} observer(s) for good?`;
  if (!(await ask(question, verb === "restart" ? `Restart ${chosen.length}` : `Delete ${chosen.length}`, names))) return;
  const byId = new Map(chosen.map((o) => [o.id, o.name]));
  try {
    const out = await api("POST", `/views/observers/${verb}`, null, { ids: chosen.map((o) => o.id) });
    list.selected.clear();
    $("#f-selected").textContent = `${out.done} ${verb === "restart" ? "restarted" : "deleted"}`;
    reportFailed(verb === "restart" ? "Restart" : "Delete", out, byId);
  } catch (err) {
    report(`${verb === "restart" ? "Restart" : "Delete"} ${chosen.length}`, err);
  }
  await refresh();
}

/** Restart or delete every failed observer (the oldest 10,000), as one action request. */
async function bulkEveryFailed(verb) {
  const n = Math.min(MAX_ACTION, state.lists.failed.page?.total ?? 0);
  if (!n) return;
  const question = verb === "restart"
    ? `Restart every failed observer (${count(n)})? Each starts again from its last checkpoint with a fresh restart budget.`
    : `Delete every failed observer (${count(n)}) for good?`;
  if (!(await ask(question, `${verb === "restart" ? "Restart" : "Delete"} ${count(n)}`))) return;
  try {
    const out = await api("POST", "/observers/actions", null, { action: verb, selector: { status: "failed" }, limit: n });
    $("#f-selected").textContent = `${count(out.done)} ${PAST[verb]}` + (out.failed ? `, ${count(out.failed)} failed` : "");
    reportFailed(verb, out);
  } catch (err) {
    report(`${verb} every failed observer`, err);
  }
  $("#f-every").checked = false;
  await refresh();
}

// The overview's bulk actions: on the observers selected on this page, as one request.
const PAST = { pause: "paused", resume: "resumed", restart: "restarted", delete: "deleted", move: "moving" };

const MAX_ACTION = 10000;  // the most one action request takes

/** The list's filters as an action's selector: every observer (not deleted) they match, or why
 * they cannot be one (the lookup box matches any part of a name; no filter matches everyone). */
function everyTarget() {
  const f = state.lists.observers.params();
  const page = state.lists.observers.page;
  if (f.q) return { why: "clear the lookup box first" };
  if (f.param) return { why: "clear the params search first" };
  if (!f.status && !f.kind && !f.pool) return { why: "filter on a status, kind or pool first" };
  if (f.status === "deleted") return { why: "deleted ones take no action" };
  const selector = Object.fromEntries(["status", "kind", "pool"].filter((k) => f[k]).map((k) => [k, f[k]]));
  const n = Math.min(MAX_ACTION, page?.total ?? 0);
  return { selector, n, filters: Object.entries(selector).map(([k, v]) => `${k} ${v}`).join(", ") };
}

async function bulkOverview(verb) {
  const list = state.lists.observers;
  const every = $("#bulk-every").checked;
  const target = every ? everyTarget() : null;
  if (target?.why) return;
  const chosen = every ? [] : (list.page?.items || []).filter((o) => list.selected.has(o.id));
  if (!every && !chosen.length) return;
  const ids = chosen.map((o) => o.id);
  const selector = every ? target.selector : { ids };
  const pool = $("#bulk-pool").value;
  const n = every ? target.n : chosen.length;
  const whom = every ? `every observer matching ${target.filters} (${count(n)}${n === MAX_ACTION ? ", the oldest" : ""})` : `${n} observer(s)`;
  const what = verb === "move" ? `Move ${whom} to pool ${pool}?` : `${verb[0].toUpperCase()}${verb.slice(1)} ${whom}?`;
  const why = {
    pause: " Each stops and keeps its checkpoint.",
    resume: " Each starts again from its checkpoint.",
    restart: " A failed one starts again with a fresh restart budget; a running one stops and starts again from its checkpoint.",
    delete: " They are ended for good.",
    move: " Each running one is handed over and resumes there from its checkpoint.",
  }[verb];
  if (!(await ask(what + why, `${verb[0].toUpperCase()}${verb.slice(1)} ${count(n)}`, chosen.map((o) => o.name)))) return;
  const byId = new Map(chosen.map((o) => [o.id, o.name]));
  try {
    const out = verb === "move"
      ? await api("POST", "/observers/move", null, { selector, to_pool: pool, limit: n })
      : await api("POST", "/observers/actions", null, { action: verb, selector, limit: n });
    list.selected.clear();
    const done = verb === "move" ? out.moved : out.done;
    const failed = verb === "move" ? 0 : out.failed;
    $("#bulk-selected").textContent = `${done} ${PAST[verb]}` + (failed ? `, ${failed} failed` : "");
    if (verb !== "move") reportFailed(verb, out, byId);  // a move answers with ids alone
  } catch (err) {
    report(`${verb} ${n}`, err);
  }
  await refresh();
}

async function renderObserver(id) {
  const [o, events, row, services] = await Promise.all([
    api("GET", `/observers/${id}`), api("GET", `/observers/${id}/events`),
    api("GET", "/views/observers", { q: id, include_deleted: "true", limit: 1 }),
    state.services.size ? null : api("GET", "/services"),
  ]);
  if (services) state.services = new Map(services.map((s) => [s.id, s]));
  const v = row.items[0] || { ...o, max_restarts: "?", in_backoff: false };
  $("#o-name").textContent = o.name;
  const pill = statusPill(v);
  $("#o-state").textContent = pill.textContent;
  $("#o-state").className = pill.className;
  $("#o-state").title = pill.title;
  const svc = o.service_id ? nameNode(v.service_name || short(o.service_id), `#/services/${o.service_id}`)
    : o.waiting ? `none: waiting (${o.waiting})` : "none";
  const fields = [["id", o.id], ["kind", o.kind], ["pool", o.pool], ["status", o.status], ["service", svc],
    ["epoch", o.epoch], ["restarts", restarts(v) || "none"], ["params", JSON.stringify(o.params)],
    ["created", when(o.created_at)], ["started", when(o.started_at)],
    ["last checkpoint", when(o.checkpointed_at)],
    ["last commit", o.committed_at ? when(o.committed_at) : el("span", "none (it emits nothing)", "muted")],
    ["last output", o.output_seq ? `seq ${o.output_seq}` : "none"], ["modified", when(o.modified_at)]];
  $("#o-fields").replaceChildren(...fields.flatMap(([k, val]) => {
    const dd = el("dd", null, k === "status" ? `status-${val}` : "");
    dd.id = `o-field-${k.replace(" ", "-")}`;
    if (val instanceof Node) dd.append(val); else dd.textContent = String(val ?? "");
    return [el("dt", k), dd];
  }));
  $("#o-checkpoint").textContent = JSON.stringify(o.checkpoint, null, 2);
  $("#o-error").textContent = o.last_error || "none";
  $("#o-traceback").textContent = o.traceback || "";
  $("#o-trace").hidden = !o.traceback;
  const buttons = [];
  const button = (label, method, suffix, question, danger) => {
    const b = el("button", label, danger ? "danger" : "");
    b.type = "button";
    b.onclick = () => act(`${label} ${o.name}`, method, `/observers/${o.id}${suffix}`, question, label, question ? [o.name] : null);
    buttons.push(b);
  };
  if (admin()) {
    if (["created", "processing"].includes(o.status))
      button("Pause", "POST", "/pause", "Pause this observer? Its copy stops; its checkpoint stays.");
    if (o.status === "paused") button("Resume", "POST", "/resume", null);
    if (o.status === "failed") button("Restart", "POST", "/restart", "Restart this failed observer?");
    if (o.status === "processing" && o.service_id)
      button("Restart", "POST", "/restart", "Restart this observer? Its copy stops (its cleanup runs) and a new one starts from its last checkpoint.");
    if (o.status !== "deleted") button("Delete", "DELETE", "", "Delete this observer for good?", true);
    // Params change only while no copy runs: a running one is paused, edited, resumed.
    if (["paused", "failed"].includes(o.status)) {
      const b = el("button", "Edit params");
      b.type = "button";
      b.onclick = () => editParams(o);
      buttons.push(b);
    }
    const clone = el("button", "Create like this");
    clone.type = "button";
    clone.onclick = () => createLike(o);
    buttons.push(clone);
  }
  if (state.editing !== o.id) $("#o-edit").hidden = true;
  $("#o-actions").replaceChildren(...buttons);
  $("#o-events tbody").replaceChildren(...events.slice().reverse().map((e) => {
    const s = state.services.get(e.service_id);
    const tr = el("tr");
    tr.append(td(when(e.at)), td(e.event), td(s ? nameNode(s.name) : e.service_name ? nameNode(e.service_name) : short(e.service_id)), td(e.epoch ?? ""), td(e.actor ?? ""), td(e.detail ?? ""));
    return tr;
  }));
}

// ------------------------------------------------------------------------------ editing
/** A JSON merge patch (RFC 7396) that turns `before` into `after` (a key gone: null). */
function mergePatch(before, after) {
  const plain = (x) => x !== null && typeof x === "object" && !Array.isArray(x);
  if (!plain(before) || !plain(after)) return after;
  const patch = {};
  for (const k of Object.keys(before)) if (!(k in after)) patch[k] = null;
  for (const [k, v] of Object.entries(after)) {
    if (JSON.stringify(before[k]) !== JSON.stringify(v)) patch[k] = k in before ? mergePatch(before[k], v) : v;
  }
  return patch;
}

function editParams(o) {
  state.editing = o.id;
  $("#o-edit").hidden = false;
  $("#o-edit-text").value = JSON.stringify(o.params, null, 2);
  $("#o-edit-cancel").onclick = () => { state.editing = null; $("#o-edit").hidden = true; };
  $("#o-edit-save").onclick = async () => {
    let after;
    try { after = JSON.parse($("#o-edit-text").value); } catch (err) { report("Edit params", err); return; }
    try {
      await api("PATCH", `/observers/${o.id}`, null, { params: mergePatch(o.params, after) });
      state.editing = null;
      $("#o-edit").hidden = true;
    } catch (err) { report(`Edit params of ${o.name}`, err); }
    await refresh();
  };
  $("#o-edit-text").focus();
}

/** The create form, filled in with this observer's kind, pool and params, under a new name. */
function createLike(o) {
  const like = { name: `${o.name}-copy`, kind: o.kind, params: o.params };
  if (o.pool !== "default") like.pool = o.pool;
  window.location.hash = "#/";
  $("#create").open = true;
  $("#create-text").value = JSON.stringify(like, null, 2);
  $("#create-text").focus();
}

// ------------------------------------------------------------------------------ creating
const BATCH = 1000;  // the most POST /observers/batch takes in one request

function parseObservers(text) {
  const t = text.trim();
  if (!t) return [];
  try {
    const whole = JSON.parse(t);
    return Array.isArray(whole) ? whole : [whole];
  } catch { /* not one JSON document: one object a line */ }
  return t.split("\n").filter((l) => l.trim()).map((l, i) => {
    try { return JSON.parse(l); } catch { throw new Error(`line ${i + 1} is not JSON`); }
  });
}

function why(problem) {
  const fields = (problem.errors || []).map((e) => `${e.loc.slice(3).join(".") || "item"}: ${e.msg}`);
  return [problem.detail, ...fields].join("; ");
}

async function createMany() {
  const progress = $("#create-progress");
  const failures = $("#create-failures");
  failures.replaceChildren();
  let items;
  try { items = parseObservers($("#create-text").value); } catch (err) { report("Create", err); return; }
  $("#create-go").disabled = true;
  let created = 0;
  try {
    for (let start = 0; start < items.length; start += BATCH) {
      const out = await api("POST", "/observers/batch", null, { observers: items.slice(start, start + BATCH) });
      created += out.created;
      for (const item of out.items.filter((x) => x.problem)) {
        const n = start + item.index + 1;
        failures.append(el("li", `#${n}: ${item.status} ${why(item.problem)}`, "failed"));
      }
      progress.textContent = `${Math.min(start + BATCH, items.length)} of ${items.length} sent, ${created} created`;
    }
    progress.textContent = `${created} of ${items.length} created` +
      (failures.children.length ? `, ${failures.children.length} failed` : "");
  } catch (err) {
    report("Create", err);
  } finally {
    $("#create-go").disabled = false;
  }
  await refresh();
}

// ------------------------------------------------------------------------------ filters
// The overview's filters live in the address (#/?status=failed&kind=…): a link or a reload
// shows the same list.
const FILTERS = ["q", "status", "kind", "pool", "param", "include_deleted"];

function filtersToUrl() {
  const f = new FormData($("#filters"));
  const params = new URLSearchParams();
  for (const k of FILTERS) { const v = (f.get(k) || "").toString().trim(); if (v) params.set(k, v); }
  const query = params.toString();
  const here = query ? `#/?${query}` : "#/";
  history.replaceState(null, "", here);
  for (const a of $$('a[href^="#/"][data-nav="overview"], a.brand')) a.setAttribute("href", here);
}

function filtersFromUrl() {
  const h = window.location.hash;
  if (route()[0] !== "overview") return;
  const params = new URLSearchParams(h.includes("?") ? h.slice(h.indexOf("?") + 1) : "");
  const form = $("#filters");
  form.elements.q.value = params.get("q") || "";
  form.elements.status.value = params.get("status") || "";
  form.elements.kind.value = params.get("kind") || "";
  form.elements.pool.value = params.get("pool") || "";
  form.elements.param.value = params.get("param") || "";
  form.elements.include_deleted.checked = params.get("include_deleted") === "true";
}

// ------------------------------------------------------------------------------ the loop
function route() {
  const h = window.location.hash;
  let m;
  if ((m = h.match(/^#\/observers\/([0-9a-f-]{36})$/))) return ["observer", m[1]];
  if ((m = h.match(/^#\/services\/([0-9a-f-]{36})$/))) return ["service", m[1]];
  if (h === "#/failed") return ["failed", null];
  if (h === "#/actions") return ["actions", null];
  return ["overview", null];
}

const RENDER = {
  overview: renderOverview, service: renderService, failed: renderFailed, actions: renderActions, observer: renderObserver,
};

async function refresh() {
  if (!state.who) return;
  if (state.busy) { state.again = true; return; }
  state.busy = true;
  try {
    const [view, id] = route();
    for (const s of Object.keys(RENDER)) $(`#${s}`).hidden = s !== view;
    for (const a of $$("#nav a")) a.classList.toggle("on", a.dataset.nav === view);
    await RENDER[view](id);
    if (!state.who) return;
    $("#updated").textContent = `${state.paused ? "paused · " : ""}updated ${stamp(new Date().toISOString())}`;
    $("#updated").classList.remove("stale");
  } catch (err) {
    if (state.who) {  // a refresh that failed says so here; it never clears a reported problem
      $("#updated").textContent = `refresh failed: ${err.message || err}`;
      $("#updated").classList.add("stale");
    }
  } finally {
    state.busy = false;
    if (state.again) { state.again = false; refresh(); }
  }
}

document.addEventListener("DOMContentLoaded", start);
