// The pfl-edge dashboard: one snapshot from /api/snapshot, then every change from /api/events.
// Everything a device sent (ids, reasons, details) is shown with textContent, never as HTML.
"use strict";

const state = { snapshot: null, charts: {}, renders: 0, clockOffset: 0 };
window.pflDashboard = state; // what the browser tests read: renders, the last snapshot's version

const $ = (id) => document.getElementById(id);
const fmt = (v, digits = 3) => (v === null || v === undefined || Number.isNaN(v) ? "-" : Number(v).toFixed(digits));
const kib = (b) => Math.round(b / 102.4) / 10;

function bytes(n) {
  if (!n) return "0 B";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function ago(seconds) {
  if (!seconds) return "never";
  const s = Math.max(0, Date.now() / 1000 + state.clockOffset - seconds);
  if (s < 60) return `${s.toFixed(0)} s ago`;
  if (s < 3600) return `${(s / 60).toFixed(0)} min ago`;
  return `${(s / 3600).toFixed(1)} h ago`;
}

function cell(row, text, className) {
  const td = document.createElement("td");
  td.textContent = text === null || text === undefined ? "-" : String(text);
  if (className) td.className = className;
  row.appendChild(td);
  return td;
}

function memoryPlan(plan) {
  if (!plan) return "-";
  return `${plan.micro_batch_size} x ${plan.accumulation_steps} (${bytes(plan.estimated_peak_bytes)} of ${bytes(plan.budget_bytes)})`;
}

function eligibility(e) {
  if (!e) return "-";
  const parts = [];
  if (e.min_free_memory_bytes !== null && e.min_free_memory_bytes !== undefined) parts.push(`free memory >= ${bytes(e.min_free_memory_bytes)}`);
  if (e.max_load_per_core !== null && e.max_load_per_core !== undefined) parts.push(`load <= ${e.max_load_per_core}/core`);
  if (e.require_mains_power) parts.push("on mains power");
  return parts.length ? parts.join(", ") : "always";
}

function renderHeader(s) {
  const c = s.coordinator || {};
  const settings = s.settings || {};
  const task = c.task || settings.task || "";
  const algorithm = c.algorithm || settings.algorithm || "";
  $("run-title").textContent = [settings.fleet || c.fleet, task, algorithm].filter(Boolean).join(" · ") || "waiting for the fleet…";
  const runState = s.finished ? "finished" : c.state || "unknown";
  $("run-state").textContent = runState;
  $("run-state").className = `badge ${runState}`;
  const total = c.rounds || settings.rounds;
  const last = s.rounds.length ? s.rounds[s.rounds.length - 1].round_id : c.round_id || 0;
  $("run-progress").textContent = total ? `round ${last} of ${total}` : `round ${last}`;
  $("source").textContent = s.source;
  $("updated").textContent = s.updated ? `last change ${ago(s.updated)}` : "no data yet";
}

function renderCards(s) {
  const online = s.fleet.filter((d) => d.online).length;
  $("card-online").textContent = `${online} / ${s.fleet.length}`;
  const last = s.rounds[s.rounds.length - 1];
  $("card-answered").textContent = last ? `${last.participants} / ${last.selected}` : "-";
  const evaluated = s.rounds.filter((r) => r.evaluation);
  const evaluation = evaluated.length ? evaluated[evaluated.length - 1].evaluation : null;
  const metric = s.devices.length ? s.devices[0].metric_name : "metric";
  $("card-metric-label").textContent = `personalized ${metric}`;
  $("card-personalized").textContent = evaluation ? fmt(evaluation.personalized_mean) : "-";
  $("card-global").textContent = evaluation ? fmt(evaluation.global) : "-";
  const gains = deviceGains(s);
  const helped = gains.filter((g) => g[1] > 0).length;
  $("card-helped").textContent = gains.length ? `${helped} of ${gains.length}` : "-";
  const total = s.rounds.reduce((sum, r) => sum + r.bytes_up + r.bytes_down, 0);
  $("card-bytes").textContent = bytes(total);
}

function renderFleet(s) {
  const body = document.querySelector("#fleet tbody");
  const rows = document.createDocumentFragment();
  for (const d of s.fleet) {
    const tr = document.createElement("tr");
    tr.dataset.device = d.device;
    cell(tr, d.device);
    const online = cell(tr, d.online ? "online" : "offline", "online");
    const dot = document.createElement("span");
    dot.className = d.online ? "dot on" : "dot";
    online.prepend(dot);
    cell(tr, d.state);
    cell(tr, ago(d.last_seen));
    cell(tr, d.round);
    cell(tr, d.rounds_taken);
    cell(tr, fmt(d.last_loss));
    cell(tr, d.num_train_samples);
    cell(tr, memoryPlan(d.memory_plan));
    cell(tr, eligibility(d.eligibility), "reason");
    cell(tr, d.declines ? `${d.declines}: ${d.last_decline}` : "0", "reason");
    cell(tr, d.dropped);
    const flags = [d.quarantined ? "quarantined" : "", d.flapping ? "flapping (one id, two devices?)" : ""].filter(Boolean);
    cell(tr, flags.join(", "), flags.length ? "flag" : "");
    rows.appendChild(tr);
  }
  body.replaceChildren(rows);
  const more = s.fleet_left_out ? `, ${s.fleet_left_out} more not shown` : "";
  const refused = s.refused ? `; ${s.refused} messages ignored: their topic may not carry them` : "";
  $("fleet-count").textContent = `(${s.fleet.length} devices${more}${refused})`;
}

function renderRounds(s) {
  const body = document.querySelector("#rounds tbody");
  const rows = document.createDocumentFragment();
  for (const r of s.rounds.slice(-200).reverse()) {
    const tr = document.createElement("tr");
    for (const v of [r.round_id, r.selected, r.participants, r.skipped, late(r), r.dropped, fmt(r.train_loss), bytes(r.bytes_up), bytes(r.bytes_down), fmt(r.wall_seconds, 2)]) cell(tr, v);
    rows.appendChild(tr);
  }
  body.replaceChildren(rows);
}

function renderSettings(s) {
  const list = document.createDocumentFragment();
  for (const [key, value] of Object.entries(s.settings || {})) {
    if (value === null || value === "") continue;
    list.appendChild(Object.assign(document.createElement("dt"), { textContent: key }));
    list.appendChild(Object.assign(document.createElement("dd"), { textContent: String(value) }));
  }
  $("settings").replaceChildren(list);
}

const late = (r) => Math.max(0, r.selected - r.participants - r.skipped);

function deviceGains(s) {
  const higherIsBetter = !s.devices.length || s.devices[0].metric_name === "accuracy";
  return s.devices
    .filter((d) => d.global_model !== null && d.global_model !== undefined)
    .map((d) => [d.num_train_samples, higherIsBetter ? d.personalized - d.global_model : d.global_model - d.personalized])
    .sort((a, b) => a[0] - b[0]);
}

const ROUND_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000];
const COLORS = ["#2f5bd3", "#1a7f4b", "#b54708", "#b42318", "#7a42c8"];

function chart(id, series, data, extra = {}) {
  const el = $(id);
  const width = Math.max(300, el.clientWidth);
  const label = extra.yLabel || "";
  if (state.charts[id] && state.charts[id].pflLabel === label) {
    state.charts[id].setData(data);
    return;
  }
  if (state.charts[id]) state.charts[id].destroy(); // its axis label changed (the metric became known)
  const options = {
    width, height: 220, series: [{ label: extra.xLabel || "round" }, ...series],
    scales: { x: { time: false } },
    axes: [{ label: extra.xLabel || "round", incrs: ROUND_STEPS }, { label: extra.yLabel || "" }],
    legend: { live: true },
    ...extra.options,
  };
  state.charts[id] = new uPlot(options, data, el);
  state.charts[id].pflLabel = label;
}

const line = (label, i, more = {}) => ({ label, stroke: COLORS[i], width: 2, spanGaps: true, points: { show: true, size: 4 }, ...more });

function renderCharts(s) {
  const rounds = s.rounds;
  const x = rounds.map((r) => r.round_id);
  const ev = (key) => rounds.map((r) => (r.evaluation && r.evaluation[key] !== undefined ? r.evaluation[key] : null));
  const metric = s.devices.length ? s.devices[0].metric_name : "metric";
  $("metric-caption").textContent = `Held-out ${metric} per round (device means)`;
  chart("chart-metric", [line("personalized", 0), line("global", 1), line("worst 10%", 2)], [x, ev("personalized_mean"), ev("global"), ev("personalized_worst10")], { yLabel: metric });
  chart("chart-loss", [line("train loss", 0)], [x, rounds.map((r) => r.train_loss)], { yLabel: "loss" });
  chart(
    "chart-timeline",
    [line("selected", 0), line("answered", 1), line("declined", 2), line("late", 3), line("dropped msgs", 4)],
    [x, rounds.map((r) => r.selected), rounds.map((r) => r.participants), rounds.map((r) => r.skipped), rounds.map(late), rounds.map((r) => r.dropped)],
    { yLabel: "devices" },
  );
  chart(
    "chart-bytes",
    [line("up KiB", 0), line("down KiB", 1), line("wall s", 2, { scale: "s" })],
    [x, rounds.map((r) => kib(r.bytes_up)), rounds.map((r) => kib(r.bytes_down)), rounds.map((r) => r.wall_seconds)],
    { yLabel: "KiB", options: { axes: [{ label: "round", incrs: ROUND_STEPS }, { label: "KiB" }, { scale: "s", side: 1, label: "seconds", grid: { show: false } }] } },
  );
  const gains = deviceGains(s);
  chart(
    "chart-gain",
    [{ label: "device gain", stroke: COLORS[0], fill: COLORS[0], paths: () => null, points: { show: true, size: 7, fill: COLORS[0] } }, { label: "no gain", stroke: "#999", width: 1, dash: [4, 4], points: { show: false } }],
    [gains.map((g) => g[0]), gains.map((g) => g[1]), gains.map(() => 0)],
    { xLabel: "training samples", yLabel: `gain in ${metric}` },
  );
}

function render(snapshot) {
  if (state.snapshot && snapshot.version < state.snapshot.version && snapshot.source === state.snapshot.source) return;
  state.snapshot = snapshot;
  state.clockOffset = snapshot.now - Date.now() / 1000;
  renderHeader(snapshot);
  renderCards(snapshot);
  renderCharts(snapshot);
  renderFleet(snapshot);
  renderRounds(snapshot);
  renderSettings(snapshot);
  state.renders += 1;
  document.body.dataset.version = String(snapshot.version);
}

function connect() {
  const events = new EventSource("api/events");
  events.addEventListener("snapshot", (e) => render(JSON.parse(e.data)));
  events.onopen = () => { $("connection").textContent = "live"; $("connection").className = "badge live"; };
  events.onerror = () => { $("connection").textContent = "reconnecting"; $("connection").className = "badge offline"; };
}

window.addEventListener("resize", () => {
  for (const [id, plot] of Object.entries(state.charts)) plot.setSize({ width: Math.max(300, $(id).clientWidth), height: 220 });
});
setInterval(() => state.snapshot && (renderHeader(state.snapshot), renderFleet(state.snapshot)), 5000); // "last seen" ages
fetch("api/snapshot").then((r) => r.json()).then(render).catch(() => {});
connect();
