// The live console: it reads the same API as the command line, every two seconds, and acts
// through it. No build step; no data ever goes into innerHTML. The API token (if the manager
// asks for one) is kept in this tab's sessionStorage and sent as a bearer header: no cookie.
"use strict";

const REFRESH_MS = 2000;
const PAGE = 50;
const state = { offset: 0, next: null, services: new Map(), timer: null, busy: false, asked: false };
const $ = (sel) => document.querySelector(sel);

function token() { return sessionStorage.getItem("orch-token") || ""; }

async function api(method, path, params, json) {
  const url = new URL(path, window.location.origin);
  for (const [k, v] of Object.entries(params || {})) if (v !== "" && v != null) url.searchParams.set(k, v);
  const headers = { Accept: "application/json" };
  if (token()) headers.Authorization = `Bearer ${token()}`;
  const init = { method, headers };
  if (json !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(json);
  }
  const r = await fetch(url, init);
  const body = r.headers.get("content-type")?.includes("json") ? await r.json() : null;
  if (r.status === 401 && !state.asked) {
    state.asked = true;  // once; the "API token" button asks again
    askToken(token() ? "That API token was refused." : "This manager wants an API token.");
  }
  if (!r.ok) throw new Error(`${r.status}: ${body?.detail ?? body?.title ?? r.statusText}`);
  return body;
}

function askToken(why) {
  const t = window.prompt(`${why}\nAPI token (kept in this tab only):`, "");
  if (t !== null) sessionStorage.setItem("orch-token", t.trim());
}

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text != null) e.textContent = String(text);
  if (cls) e.className = cls;
  return e;
}

function row(cells, cls) {
  const tr = el("tr", null, cls);
  for (const c of cells) tr.append(c instanceof Node ? wrap(c) : el("td", c));
  return tr;
}

function wrap(node) { const td = el("td"); td.append(node); return td; }
function short(id) { return id ? id.slice(0, 8) : ""; }
function ago(iso) {
  if (!iso) return "";
  const s = (Date.now() - Date.parse(iso)) / 1000;
  return s < 1 ? "now" : s < 120 ? `${s.toFixed(1)} s ago` : `${Math.round(s / 60)} min ago`;
}

function showError(err) {
  const box = $("#error");
  box.hidden = !err;
  box.textContent = err ? String(err.message || err) : "";
}

async function act(method, path, question) {
  if (question && !window.confirm(question)) return;
  try { await api(method, path); showError(null); } catch (err) { showError(err); }
  await refresh();
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
  try { items = parseObservers($("#create-text").value); } catch (err) { showError(err); return; }
  showError(null);
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
    showError(err);
  } finally {
    $("#create-go").disabled = false;
  }
  await refresh();
}

// ------------------------------------------------------------------------------ the views
async function renderCluster() {
  const filters = Object.fromEntries(new FormData($("#filters")));
  const [services, page, leader] = await Promise.all([
    api("GET", "/services"),
    api("GET", "/observers", { ...filters, limit: PAGE, offset: state.offset }),
    api("GET", "/leader"),
  ]);
  state.services = new Map(services.map((s) => [s.id, s]));
  $("#leader").textContent = leader.holder ? `leader: ${leader.holder}` : "no leader";
  const sbody = $("#services tbody");
  sbody.replaceChildren(...services.map((s) => {
    const bar = el("span", null, "bar");
    const fill = el("span");
    fill.style.width = `${Math.min(100, (100 * s.running) / s.worker_count)}%`;
    bar.append(fill);
    const load = el("span");
    load.append(bar, `${s.running} / ${s.worker_count}`);
    const drain = el("button", "drain", "danger");
    drain.disabled = s.draining;
    drain.onclick = () => act("POST", `/services/${s.id}/drain`,
      `Drain ${s.name}? Every observer on it moves to the others, and it takes no new ones.`);
    return row([s.name, el("span", short(s.id), "mono"), load,
      s.draining ? "draining" : "taking work", ago(s.last_heartbeat_at), drain]);
  }));
  const obody = $("#observers tbody");
  obody.replaceChildren(...page.items.map((o) => {
    const link = el("a", o.name);
    link.href = `#/observers/${o.id}`;
    const svc = state.services.get(o.service_id);
    const cls = o.status === "failed" ? "failed" : o.restart_count > 0 ? "restarting" : "";
    const tr = row([link, o.kind, el("span", o.status, `status-${o.status}`),
      svc ? svc.name : short(o.service_id), o.epoch,
      el("span", o.restart_count || "", o.restart_count ? "restarts" : ""),
      ago(o.checkpointed_at)], cls);
    tr.dataset.id = o.id;
    return tr;
  }));
  state.next = page.next_offset;
  $("#page").textContent = `${state.offset + 1}–${state.offset + page.items.length}`;
  $("#prev").disabled = state.offset === 0;
  $("#next").disabled = page.next_offset == null;
}

async function renderObserver(id) {
  const [o, events] = await Promise.all([
    api("GET", `/observers/${id}`), api("GET", `/observers/${id}/events`),
  ]);
  if (state.services.size === 0) {
    const services = await api("GET", "/services");
    state.services = new Map(services.map((s) => [s.id, s]));
  }
  $("#o-name").textContent = o.name;
  const svc = state.services.get(o.service_id);
  const fields = [["id", o.id], ["kind", o.kind], ["status", o.status],
    ["service", svc ? `${svc.name} (${short(o.service_id)})` : short(o.service_id) || "none"],
    ["epoch", o.epoch], ["restarts", o.restart_count], ["params", JSON.stringify(o.params)],
    ["created", o.created_at], ["last checkpoint", o.checkpointed_at || "never"]];
  $("#o-fields").replaceChildren(...fields.flatMap(([k, v]) => {
    const dd = el("dd", v, k === "status" ? `status-${v}` : "");
    dd.id = `o-field-${k}`;
    return [el("dt", k), dd];
  }));
  $("#o-checkpoint").textContent = JSON.stringify(o.checkpoint, null, 2);
  $("#o-error").textContent = o.last_error || "none";
  const buttons = [];
  const button = (label, method, suffix, question, danger) => {
    const b = el("button", label, danger ? "danger" : "");
    b.onclick = () => act(method, `/observers/${o.id}${suffix}`, question);
    buttons.push(b);
  };
  if (["created", "processing"].includes(o.status))
    button("Pause", "POST", "/pause", `Pause ${o.name}? Its copy stops; its checkpoint stays.`);
  if (o.status === "paused") button("Resume", "POST", "/resume", null);
  if (o.status === "failed") button("Restart", "POST", "/restart", `Restart ${o.name}?`);
  if (o.status !== "deleted")
    button("Delete", "DELETE", "", `Delete ${o.name} for good?`, true);
  $("#o-actions").replaceChildren(...buttons);
  $("#o-events tbody").replaceChildren(...events.slice().reverse().map((e) => {
    const s = state.services.get(e.service_id);
    return row([e.at.replace("T", " ").slice(0, 23), e.event, s ? s.name : short(e.service_id),
      e.epoch ?? "", e.detail ?? ""]);
  }));
}

// ------------------------------------------------------------------------------ the loop
function route() {
  const m = window.location.hash.match(/^#\/observers\/([0-9a-f-]{36})$/);
  $("#cluster").hidden = Boolean(m);
  $("#observer").hidden = !m;
  return m ? m[1] : null;
}

async function refresh() {
  if (state.busy) return;
  state.busy = true;
  try {
    const id = route();
    await (id ? renderObserver(id) : renderCluster());
    $("#updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    showError(null);
  } catch (err) {
    showError(err);
  } finally {
    state.busy = false;
  }
}

async function start() {
  try {
    const kinds = await api("GET", "/kinds");
    $("#filters select[name=kind]").append(...kinds.map((k) => el("option", k.name)));
  } catch (err) { showError(err); }
  $("#filters").addEventListener("input", () => { state.offset = 0; refresh(); });
  $("#filters").addEventListener("submit", (e) => e.preventDefault());
  $("#prev").onclick = () => { state.offset = Math.max(0, state.offset - PAGE); refresh(); };
  $("#next").onclick = () => { if (state.next != null) { state.offset = state.next; refresh(); } };
  $("#create-go").onclick = createMany;
  $("#token").onclick = () => { state.asked = false; askToken("Set the API token."); refresh(); };
  window.addEventListener("hashchange", refresh);
  await refresh();
  state.timer = setInterval(refresh, REFRESH_MS);
}

document.addEventListener("DOMContentLoaded", start);
