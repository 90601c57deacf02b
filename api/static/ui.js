// The nvmeof dashboard: polls /ui/stats (cumulative counters, the same as /metrics) once a second and
// draws rates and latency percentiles from the difference of two snapshots; reads and changes the
// configuration through the REST API with the login cookie. No library, nothing from the network.
// Every string from the target (NQNs, paths, addresses) goes into the page with textContent only.
"use strict";

const API = "/api/v1";
const POLL_MS = 1000;
const HISTORY_S = 300;
const COLORS = ["#2357c5", "#d9480f", "#2b8a3e", "#862e9c", "#c92a2a", "#0b7285", "#e67700", "#5c940d"];

// Open state, read by the browser test (tests/test_ui_browser.py): series[group][key] = [{t, iops, mbps, p50, p99}]
const dashboard = { series: { ns: {}, host: {} }, last: null, samples: 0, config: null };
window.nvmeofDashboard = dashboard;

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const child of children) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

function setStatus(text, error = false) {
  const s = document.getElementById("status");
  s.textContent = text;
  s.className = error ? "error" : "";
}

class Unauthorized extends Error {}

async function call(method, path, body) {
  const init = { method, credentials: "same-origin", headers: {} };
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";   // the API refuses other bodies (api/auth.py)
    init.body = JSON.stringify(body);
  }
  const resp = await fetch(path, init);
  if (resp.status === 401) throw new Unauthorized();
  const text = await resp.text();
  const data = text ? JSON.parse(text) : null;
  if (!resp.ok) {
    const detail = data && data.detail;
    throw new Error(typeof detail === "string" ? detail : JSON.stringify(detail || resp.statusText));
  }
  return data;
}

function showLogin() {
  document.getElementById("main").hidden = true;
  document.getElementById("login").hidden = false;
  setStatus("not logged in");
}

// -- rates and percentiles ---------------------------------------------------------------------------

function percentile(hist, bounds, q) {
  // hist: per-bucket counts over one interval; linear inside the bucket, as histogram_quantile() does.
  let total = 0;
  for (const n of hist) total += n;
  if (!total) return null;
  const rank = q * total;
  let seen = 0;
  for (let i = 0; i < hist.length; i++) {
    if (seen + hist[i] >= rank && hist[i] > 0) {
      const lower = i === 0 ? 0 : bounds[i - 1];
      return lower + (bounds[i] - lower) * ((rank - seen) / hist[i]);
    }
    seen += hist[i];
  }
  return bounds[bounds.length - 1];
}

function rows(snap, group) {
  const out = new Map();
  for (const r of snap[group === "ns" ? "namespaces" : "hosts"]) {
    out.set(group === "ns" ? `${r.subnqn} nsid ${r.nsid}` : `${r.hostnqn} on ${r.subnqn}`, r);
  }
  return out;
}

function addSamples(prev, snap) {
  const dt = snap.time - prev.time;
  if (dt <= 0) return;
  for (const group of ["ns", "host"]) {
    const before = rows(prev, group);
    const series = dashboard.series[group];
    for (const [key, now] of rows(snap, group)) {
      const old = before.get(key);
      if (!old) continue;
      const ios = now.reads + now.writes - old.reads - old.writes;
      if (ios < 0) continue;   // counters restarted (namespace re-created): skip one sample
      const hist = now.read_hist.map((n, i) => n + now.write_hist[i] - old.read_hist[i] - old.write_hist[i]);
      const p50 = percentile(hist, snap.latency_bounds, 0.5);
      const p99 = percentile(hist, snap.latency_bounds, 0.99);
      (series[key] ||= []).push({
        t: snap.time, iops: ios / dt,
        mbps: (now.read_bytes + now.write_bytes - old.read_bytes - old.write_bytes) / dt / 1e6,
        p50: p50 === null ? null : p50 * 1e6, p99: p99 === null ? null : p99 * 1e6,
        // time commands spent waiting for a QoS limit, summed over commands: 1000 = one command always waiting
        throttle: ((now.throttled_ns || 0) - (old.throttled_ns || 0)) / dt / 1e6,
      });
    }
    for (const key of Object.keys(series)) {
      series[key] = series[key].filter((p) => p.t > snap.time - HISTORY_S);
      if (!series[key].length) delete series[key];
    }
  }
  dashboard.samples += 1;
}

// -- charts ----------------------------------------------------------------------------------------------

function niceMax(v) {
  if (v <= 0) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function fmt(v) {
  if (v >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (v >= 1e3) return (v / 1e3).toFixed(1) + "k";
  return Number.isInteger(v) ? String(v) : v.toFixed(1);
}

function span(group, now) {
  // Seconds the x axis covers: the samples there are (a page that just opened), at least a minute.
  let oldest = now;
  for (const points of Object.values(dashboard.series[group])) if (points.length) oldest = Math.min(oldest, points[0].t);
  return Math.min(HISTORY_S, Math.max(60, Math.ceil((now - oldest) / 60) * 60));
}

function drawChart(canvas, group, fields, now) {
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  canvas.width = w * ratio;
  canvas.height = h * ratio;
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  const left = 42, bottom = 16, top = 6, plotW = w - left - 6, plotH = h - top - bottom;
  const keys = Object.keys(dashboard.series[group]).sort();
  let max = 0;
  for (const key of keys) for (const p of dashboard.series[group][key]) for (const f of fields) max = Math.max(max, p[f] || 0);
  max = niceMax(max);
  ctx.font = "10px system-ui, sans-serif";
  ctx.fillStyle = "#667085";
  ctx.strokeStyle = "#e4e7ec";
  ctx.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const y = top + plotH - (plotH * i) / 4;
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(left + plotW, y); ctx.stroke();
    ctx.fillText(fmt((max * i) / 4), 2, y + 3);
  }
  const width = span(group, now);
  ctx.fillText(`-${width / 60} min`, left, h - 3);
  ctx.fillText("now", left + plotW - 18, h - 3);
  const x = (t) => left + plotW - ((now - t) / width) * plotW;
  const y = (v) => top + plotH - (v / max) * plotH;
  keys.forEach((key, n) => {
    fields.forEach((f, k) => {
      ctx.strokeStyle = COLORS[n % COLORS.length];
      ctx.lineWidth = 1.5;
      ctx.setLineDash(k === 0 ? [] : [4, 3]);
      ctx.beginPath();
      let pen = false;
      for (const p of dashboard.series[group][key]) {
        if (p[f] === null || now - p.t > width) { pen = false; continue; }
        if (pen) ctx.lineTo(x(p.t), y(p[f])); else ctx.moveTo(x(p.t), y(p[f]));
        pen = true;
      }
      ctx.stroke();
    });
  });
  ctx.setLineDash([]);
}

function drawAll(now) {
  for (const group of ["ns", "host"]) {
    drawChart(document.getElementById(`chart-${group}-iops`), group, ["iops"], now);
    drawChart(document.getElementById(`chart-${group}-mbps`), group, ["mbps"], now);
    drawChart(document.getElementById(`chart-${group}-lat`), group, ["p99", "p50"], now);
    drawChart(document.getElementById(`chart-${group}-throttle`), group, ["throttle"], now);
    const legend = document.getElementById(`legend-${group}`);
    const keys = Object.keys(dashboard.series[group]).sort();
    legend.replaceChildren(...keys.map((key, n) => {
      const swatch = el("span", { class: "swatch" });
      swatch.style.background = COLORS[n % COLORS.length];   // CSSOM: the CSP allows no style attributes
      return el("li", {}, swatch, key);
    }));
    if (!keys.length) legend.append(el("li", { class: "muted" }, "no I/O counters yet"));
  }
}

async function poll() {
  try {
    const snap = await call("GET", "/ui/stats");
    if (dashboard.last) addSamples(dashboard.last, snap);
    dashboard.last = snap;
    drawAll(snap.time);
  } catch (err) {
    if (err instanceof Unauthorized) { showLogin(); return; }
    setStatus(`statistics: ${err.message}`, true);
  }
  setTimeout(poll, POLL_MS);
}

// -- configuration tables and actions --------------------------------------------------------------

const MiB = 1 << 20;
const enc = encodeURIComponent;

async function act(what, fn) {
  try {
    await fn();
    setStatus(`${what}: done`);
  } catch (err) {
    if (err instanceof Unauthorized) { showLogin(); return; }
    setStatus(`${what} failed: ${err.message}`, true);
  }
  await refresh();
}

function namespaceTable(sub) {
  const body = sub.namespaces.map((ns) => {
    const size = el("input", { type: "number", min: "1", value: String(Math.round(ns.size / MiB)), "aria-label": `new size of namespace ${ns.nsid} in MiB` });
    return el("tr", { "data-nsid": String(ns.nsid) },
      el("td", {}, ns.nsid), el("td", {}, ns.backend), el("td", { class: "mono" }, ns.path || ""),
      el("td", {}, `${(ns.size / MiB).toFixed(0)} MiB`), el("td", {}, ns.block_size),
      el("td", {}, ns.enabled ? (ns.read_only ? "read-only" : "read-write") : "disabled"),
      el("td", { class: "reservation", title: "persistent reservation (nvmeof ns reservations NQN NSID)" },
        ns.registrants ? `${ns.reservation}, ${ns.registrants} registrant${ns.registrants === 1 ? "" : "s"}` : "none"),
      el("td", { class: "visibility mono", title: "hosts that see it (nvmeof ns host add|remove, ns set-auto-visible)" },
        ns.auto_visible === false ? (ns.hosts.join(", ") || "no host") : "all hosts"),
      el("td", {}, el("form", { class: "inline resize", onsubmit: (e) => {
        e.preventDefault();
        const bytes = Number(size.value) * MiB;
        const shrink = bytes < ns.size;
        if (shrink && !confirm(`Shrink namespace ${ns.nsid}? Hosts lose its tail.`)) return;
        act(`resize nsid ${ns.nsid}`, () => call("POST", `${API}/subsystems/${enc(sub.nqn)}/namespaces/${ns.nsid}/resize`,
          { size: bytes, allow_shrink: shrink }));
      } }, size, "MiB", el("button", { type: "submit" }, "Resize"))),
      el("td", {}, el("button", { class: "danger remove", onclick: () => {
        if (!confirm(`Remove namespace ${ns.nsid} from ${sub.nqn}?`)) return;
        act(`remove nsid ${ns.nsid}`, () => call("DELETE", `${API}/subsystems/${enc(sub.nqn)}/namespaces/${ns.nsid}`));
      } }, "Remove")));
  });
  return el("table", { class: "namespaces" },
    el("thead", {}, el("tr", {}, ...["nsid", "backend", "path", "size", "block", "state", "reservation", "visible to", "", ""].map((h) => el("th", {}, h)))),
    el("tbody", {}, ...body));
}

function addNamespaceForm(sub) {
  const backend = el("select", { name: "backend" }, ...["ram", "null", "file"].map((b) => el("option", { value: b }, b)));
  const size = el("input", { name: "size", type: "number", min: "1", value: "64", "aria-label": "size in MiB" });
  const path = el("input", { name: "path", placeholder: "path (file backend)", size: "28" });
  const create = el("input", { name: "create", type: "checkbox" });
  return el("form", { class: "inline add-namespace", onsubmit: (e) => {
    e.preventDefault();
    const body = { backend: backend.value, size: Number(size.value) * MiB };
    if (backend.value === "file") { body.path = path.value; body.create = create.checked; }
    act("add namespace", () => call("POST", `${API}/subsystems/${enc(sub.nqn)}/namespaces`, body));
  } }, "Add namespace:", backend, size, "MiB", path, el("label", {}, create, "create file"),
  el("button", { type: "submit", class: "primary" }, "Add"));
}

function hostsBlock(sub) {
  const list = el("ul", { class: "hosts" }, ...sub.hosts.map((h) => el("li", { class: "mono" }, h, " ",
    el("button", { class: "danger deny", onclick: () => {
      if (!confirm(`Deny host ${h}? Its controllers on ${sub.nqn} are disconnected.`)) return;
      act("deny host", () => call("DELETE", `${API}/subsystems/${enc(sub.nqn)}/hosts/${enc(h)}`));
    } }, "Deny"))));
  const hostnqn = el("input", { name: "hostnqn", placeholder: "nqn.2014-08.org.nvmexpress:uuid:...", size: "48" });
  const form = el("form", { class: "inline allow-host", onsubmit: (e) => {
    e.preventDefault();
    act("allow host", () => call("POST", `${API}/subsystems/${enc(sub.nqn)}/hosts`, { hostnqn: hostnqn.value }));
  } }, "Allow host:", hostnqn, el("button", { type: "submit" }, "Allow"));
  if (sub.allow_any_host) {
    // The API refuses a host list here (it would not be enforced): say so instead of offering the form.
    return el("div", {}, el("p", { class: "muted" }, "Hosts: any host may connect (allow_any_host)."), list);
  }
  return el("div", {}, el("p", { class: "muted" }, "Hosts: only these may connect."), list, form);
}

function renderSubsystems(subs) {
  const box = document.getElementById("subsystems");
  const nvm = subs.filter((s) => s.subtype !== "discovery");
  box.replaceChildren(...nvm.map((sub) => el("div", { class: "subsystem", "data-nqn": sub.nqn },
    el("h3", {}, sub.nqn), el("p", { class: "muted" }, `serial ${sub.serial}, model ${sub.model}`),
    namespaceTable(sub), addNamespaceForm(sub), hostsBlock(sub))));
  if (!nvm.length) box.append(el("p", { class: "muted" }, "no subsystems"));
}

function renderControllers(ctrls) {
  const tbody = document.querySelector("#controllers tbody");
  tbody.replaceChildren(...ctrls.map((c) => {
    const admin = c.queues.find((q) => q.qid === 0) || {};
    const digests = [admin.hdgst ? "header" : null, admin.ddgst ? "data" : null].filter(Boolean).join("+") || "none";
    return el("tr", {}, el("td", {}, c.cntlid), el("td", { class: "mono" }, c.subnqn), el("td", { class: "mono" }, c.hostnqn),
      el("td", { class: "mono" }, c.peer), el("td", {}, c.transport), el("td", {}, c.queues.filter((q) => q.qid > 0).length),
      el("td", {}, digests), el("td", {}, c.kato_ms ? `${c.kato_ms / 1000} s` : "off"),
      el("td", {}, new Date(c.connected_since * 1000).toLocaleTimeString()));
  }));
  if (!ctrls.length) tbody.append(el("tr", {}, el("td", { colspan: "9", class: "muted" }, "no host is connected")));
}

function renderListeners(listeners) {
  const ul = document.getElementById("listeners");
  ul.replaceChildren(...listeners.map((l) => el("li", { class: "mono" },
    `${l.trtype}://${l.adrfam === "ipv6" ? `[${l.traddr}]` : l.traddr}:${l.trsvcid}${l.discovery ? "  (discovery)" : ""}`)));
  if (!listeners.length) ul.append(el("li", { class: "muted" }, "no listeners"));
}

async function refresh() {
  try {
    const [subs, ctrls, listeners] = await Promise.all([
      call("GET", `${API}/subsystems`), call("GET", `${API}/controllers`), call("GET", `${API}/listeners`)]);
    dashboard.config = { subsystems: subs, controllers: ctrls, listeners };
    document.getElementById("login").hidden = true;
    document.getElementById("main").hidden = false;
    renderSubsystems(subs);
    renderControllers(ctrls);
    renderListeners(listeners);
    return true;
  } catch (err) {
    if (err instanceof Unauthorized) { showLogin(); return false; }
    setStatus(`configuration: ${err.message}`, true);
    return true;
  }
}

async function start() {
  if (!(await refresh())) return;
  if (!document.getElementById("status").textContent) setStatus("connected");
  poll();
  // Controllers come and go without the page doing anything: re-read the configuration now and then,
  // but not while the user is typing into one of its forms.
  setInterval(() => { if (!document.activeElement || !document.activeElement.closest("form")) refresh(); }, 3000);
}

document.addEventListener("DOMContentLoaded", start);
