// The fleet table: sorted, filtered and searched in the page; only the rows in view are drawn
// (a window of reused <tr>s between two spacers), and a row keeps its selection across updates.
"use strict";

const ROW_HEIGHT = 29; // px, fixed (dashboard.css: #fleet td height): the spacers depend on it
const OVERSCAN = 8;

const fleet = { rows: [], view: [], sort: { key: "attention", desc: true }, selected: null, search: "", filter: "all", dp: false, results: new Map(), extra: [] };

// Every column: its header, how a row shows in it, how it sorts. Columns marked `when` appear
// only when some row carries their field (the coordinator may not publish it yet).
const FLEET_COLUMNS = [
  { key: "device", label: "device", text: (d) => d.device, sort: (d) => d.device },
  { key: "online", label: "online", text: (d) => (d.online ? "online" : "offline"), sort: (d) => (d.online ? 1 : 0), className: "online" },
  { key: "state", label: "state", text: (d) => d.state || "-", sort: (d) => d.state || "" },
  { key: "last_seen", label: "last seen", text: (d) => ago(d.last_seen), sort: (d) => d.last_seen || 0 },
  { key: "round", label: "round", text: (d) => d.round ?? "-", sort: (d) => d.round ?? -1 },
  { key: "rounds_taken", label: "rounds taken", text: (d) => d.rounds_taken, sort: (d) => d.rounds_taken || 0 },
  { key: "last_loss", label: "last loss", text: (d) => lossText(d.last_loss), sort: (d) => d.last_loss ?? Infinity, title: () => (fleet.dp ? "devices send no loss under differential privacy" : "") },
  { key: "metric", label: "held-out", text: (d) => fmt(result(d).metric), sort: (d) => result(d).metric ?? -Infinity },
  { key: "gain", label: "gain", text: (d) => fmt(result(d).gain), sort: (d) => result(d).gain ?? -Infinity },
  { key: "num_train_samples", label: "samples", text: (d) => d.num_train_samples ?? "-", sort: (d) => d.num_train_samples ?? -1 },
  { key: "bytes", label: "bytes", when: "bytes_up", text: (d) => (present(d.bytes_up) ? bytes(d.bytes_up + (d.bytes_down || 0)) : "-"), sort: (d) => (d.bytes_up || 0) + (d.bytes_down || 0) },
  { key: "round_seconds", label: "round s", when: "round_seconds", text: (d) => fmt(d.round_seconds, 1), sort: (d) => d.round_seconds ?? -1 },
  { key: "declines", label: "declines", text: (d) => d.declines, sort: (d) => d.declines || 0 },
  { key: "dropped", label: "dropped", text: (d) => d.dropped, sort: (d) => d.dropped || 0 },
  { key: "flags", label: "flags", text: flags, sort: (d) => flags(d), className: "flag" },
  { key: "detail", label: "detail", text: (d) => d.detail || d.last_decline || "", sort: (d) => d.detail || "", className: "reason" },
];

const result = (d) => fleet.results.get(d.device) || {};
const lossText = (v) => (fleet.dp && (!present(v) || v === 0) ? "n/r (DP)" : fmt(v));

function flags(d) {
  return [d.quarantined ? "quarantined" : "", d.flapping ? "flapping (one id, two devices?)" : ""].filter(Boolean).join(", ");
}

// "Needs attention first": quarantined or flapping, then offline, then declining, then the rest.
const attention = (d) => (d.quarantined || d.flapping ? 3 : 0) + (d.online ? 0 : 2) + (d.declines ? 1 : 0);
const FILTERS = {
  all: () => true,
  offline: (d) => !d.online,
  quarantined: (d) => d.quarantined || d.flapping,
  declining: (d) => d.declines > 0,
  attention: (d) => attention(d) > 0,
};

function columns() {
  return FLEET_COLUMNS.filter((c) => !c.when || fleet.rows.some((d) => present(d[c.when])));
}

function drawHead() {
  const head = $("fleet-head");
  const cols = columns();
  const cells = cols.map((c) => {
    const th = document.createElement("th");
    th.dataset.key = c.key;
    th.textContent = c.label + (fleet.sort.key === c.key ? (fleet.sort.desc ? " ▼" : " ▲") : "");
    th.setAttribute("aria-sort", fleet.sort.key === c.key ? (fleet.sort.desc ? "descending" : "ascending") : "none");
    return th;
  });
  head.replaceChildren(...cells);
  fleet.drawnColumns = cols;
  fleet.pool = []; // the cells differ: rows are made anew
}

function setFleet(s, dp) {
  fleet.rows = s.fleet;
  fleet.dp = dp;
  fleet.results = resultsById(s);
  const keys = columns().map((c) => c.key).join();
  if (!fleet.drawnColumns || fleet.drawnColumns.map((c) => c.key).join() !== keys) drawHead();
  refilter();
}

function refilter() {
  const needle = fleet.search.trim().toLowerCase();
  const keep = FILTERS[fleet.filter] || FILTERS.all;
  let view = fleet.rows.filter((d) => keep(d) && (!needle || `${d.device} ${d.state || ""} ${d.detail || ""} ${d.last_decline || ""} ${flags(d)}`.toLowerCase().includes(needle)));
  const column = FLEET_COLUMNS.find((c) => c.key === fleet.sort.key);
  const key = column ? column.sort : attention;
  const sign = fleet.sort.desc ? -1 : 1;
  view = view.map((d) => [key(d), d]).sort((a, b) => (a[0] < b[0] ? -sign : a[0] > b[0] ? sign : a[1].device < b[1].device ? -1 : 1)).map((p) => p[1]);
  fleet.view = view;
  $("fleet-shown").textContent = view.length === fleet.rows.length ? "" : `${view.length} of ${fleet.rows.length} shown`;
  drawRows();
  drawDetail();
}

function drawRows() {
  const wrap = $("fleet-wrap");
  const body = document.querySelector("#fleet tbody");
  const cols = fleet.drawnColumns || columns();
  const visible = Math.ceil((wrap.clientHeight || 480) / ROW_HEIGHT);
  const first = Math.max(0, Math.floor(wrap.scrollTop / ROW_HEIGHT) - OVERSCAN);
  const last = Math.min(fleet.view.length, first + visible + 2 * OVERSCAN);
  const count = last - first;
  if (!fleet.top) {
    fleet.top = Object.assign(document.createElement("tr"), { className: "spacer" });
    fleet.bottom = Object.assign(document.createElement("tr"), { className: "spacer" });
  }
  fleet.pool = fleet.pool || [];
  while (fleet.pool.length < count) {
    const tr = document.createElement("tr");
    for (const c of cols) tr.appendChild(Object.assign(document.createElement("td"), { className: c.className || "" }));
    fleet.pool.push(tr);
  }
  for (let i = 0; i < count; i++) fillRow(fleet.pool[i], fleet.view[first + i], cols);
  fleet.top.style.height = `${first * ROW_HEIGHT}px`;
  fleet.bottom.style.height = `${(fleet.view.length - last) * ROW_HEIGHT}px`;
  const wanted = [fleet.top, ...fleet.pool.slice(0, count), fleet.bottom];
  if (body.children.length !== wanted.length || wanted.some((tr, i) => body.children[i] !== tr)) body.replaceChildren(...wanted);
}

function fillRow(tr, d, cols) {
  if (tr.dataset.device !== d.device) tr.dataset.device = d.device;
  tr.classList.toggle("selected", d.device === fleet.selected);
  cols.forEach((c, i) => {
    const td = tr.children[i];
    const text = String(c.text(d) ?? "-");
    if (td.textContent !== text) td.textContent = text;
    if (c.key === "online") td.classList.toggle("off", !d.online);
    if (c.key === "flags" || c.key === "detail" || c.title) {
      const title = c.title ? c.title(d) : text;
      if (td.title !== title) td.title = title;
    }
  });
}

function memoryPlan(plan) {
  if (!plan) return "-";
  return `${plan.micro_batch_size} x ${plan.accumulation_steps} (${bytes(plan.estimated_peak_bytes)} of ${bytes(plan.budget_bytes)})`;
}

function eligibility(e) {
  if (!e) return "-";
  const parts = [];
  if (present(e.min_free_memory_bytes)) parts.push(`free memory >= ${bytes(e.min_free_memory_bytes)}`);
  if (present(e.max_load_per_core)) parts.push(`load <= ${e.max_load_per_core}/core`);
  if (e.require_mains_power) parts.push("on mains power");
  return parts.length ? parts.join(", ") : "always";
}

// The selected device's whole status: what does not fit a row.
function drawDetail() {
  const box = $("device-detail");
  const d = fleet.rows.find((r) => r.device === fleet.selected);
  box.hidden = !d;
  if (!d) return;
  const r = result(d);
  const facts = [
    ["device", d.device], ["status", `${d.online ? "online" : "offline"}${d.state ? `, ${d.state}` : ""}, last seen ${ago(d.last_seen)}`],
    ["detail", d.detail || "-"], ["declines", d.declines ? `${d.declines}, last: ${d.last_decline}` : "0"],
    ["held-out", present(r.metric) ? `${fmt(r.metric)} (gain ${fmt(r.gain)})` : "-"], ["last loss", lossText(d.last_loss)],
    ["memory plan", memoryPlan(d.memory_plan)], ["eligibility", eligibility(d.eligibility)], ["flags", flags(d) || "-"],
  ];
  const list = document.createElement("dl");
  for (const [k, v] of facts) list.append(Object.assign(document.createElement("dt"), { textContent: k }), Object.assign(document.createElement("dd"), { textContent: String(v) }));
  box.replaceChildren(list);
}

function fleetCsv() {
  const cols = columns();
  return csv([cols.map((c) => c.label), ...fleet.view.map((d) => cols.map((c) => c.text(d)))]);
}

function setupFleet() {
  $("fleet-wrap").addEventListener("scroll", () => { if (!fleet.frame) fleet.frame = requestAnimationFrame(() => { fleet.frame = 0; drawRows(); }); }, { passive: true });
  $("fleet-head").addEventListener("click", (e) => {
    const key = e.target.closest("th")?.dataset.key;
    if (!key) return;
    fleet.sort = { key, desc: fleet.sort.key === key ? !fleet.sort.desc : false };
    drawHead();
    refilter();
  });
  document.querySelector("#fleet tbody").addEventListener("click", (e) => {
    const device = e.target.closest("tr")?.dataset.device;
    if (!device) return;
    fleet.selected = fleet.selected === device ? null : device;
    drawRows();
    drawDetail();
  });
  $("fleet-search").addEventListener("input", (e) => { fleet.search = e.target.value; refilter(); });
  $("fleet-filter").addEventListener("change", (e) => { fleet.filter = e.target.value; refilter(); });
}
