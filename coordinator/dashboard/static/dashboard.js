// The pfl-edge dashboard, fed by the event stream: a whole snapshot first, then deltas
// (`stream.py`). Everything a device sent (ids, reasons,
// details) is shown with textContent, never as HTML.
"use strict";

const state = { snapshot: null, charts: charts.plots, renders: 0, lastRenderMs: 0, lastUpdateMs: 0, updates: 0, events: [], overlay: null, lastRoundAt: 0 };
window.pflDashboard = state; // what the browser tests and the benchmark read
const KEYED = { fleet: "device", devices: "device_id", rounds: "round_id" };
const MAX_EVENTS = 200;

// The run's state as the page names it: the coordinator's own when it says more than
// "running" (waiting, stalled, stopped...), "finished" once the run's summary exists.
function runState(s) {
  const c = s.coordinator || {};
  if (c.state === "stopped" || c.state === "finished" || s.finished) return c.state === "stopped" ? "stopped" : "finished";
  if (s.notice && !s.coordinator) return "waiting";
  return c.state || "unknown";
}

// Why the run ended or stopped: the coordinator's word (its status's `reason`, or summary.json's
// `stop_reason`) when it says one, else what the rounds and the privacy budget show.
function stopReason(s) {
  const c = s.coordinator || {};
  if (c.reason) return c.reason;
  if (s.summary && s.summary.stop_reason) return s.summary.stop_reason;
  const total = c.rounds || setting(s, "rounds");
  const done = s.rounds.length ? s.rounds[s.rounds.length - 1].round_id : 0;
  if (!s.finished || !total || done >= total) return "";
  const privacy = privacyOf(s);
  if (privacy && present(privacy.budget)) return `stopped after round ${done} of ${total}: another round would pass the privacy budget (epsilon ${fmt(privacy.spent)} of ${fmt(privacy.budget, 2)} spent)`;
  return `ended after round ${done} of ${total}`;
}

function renderHeader(s) {
  const c = s.coordinator || {};
  const task = c.task || setting(s, "task") || "";
  const algorithm = c.algorithm || setting(s, "algorithm") || "";
  $("run-title").textContent = [setting(s, "fleet") || c.fleet, task, algorithm].filter(Boolean).join(" · ") || "waiting for the fleet…";
  const name = runState(s);
  $("run-state").textContent = name;
  $("run-state").className = `badge ${name}`;
  const total = c.rounds || setting(s, "rounds");
  const last = s.rounds.length ? s.rounds[s.rounds.length - 1].round_id : c.round_id || 0;
  $("run-progress").textContent = total ? `round ${last} of ${total}` : `round ${last}`;
  $("source").textContent = s.source;
  $("updated").textContent = s.updated ? `last change ${ago(s.updated)} (${timeOfDay(s.updated)})` : "no data yet";
}

// One line under the header for a state that needs words: waiting (who, how long), stalled,
// stopped or finished early (why), or the server's notice (a run directory not made yet).
function renderBanner(s) {
  const c = s.coordinator || {};
  const name = runState(s);
  let text = "";
  if (name === "waiting" && c.state === "waiting") {
    const missing = c.missing || [];
    const left = present(c.deadline) ? `, ${duration(c.deadline - (Date.now() / 1000 + clock.offset))} left` : present(c.time_left) ? `, ${duration(c.time_left)} left` : "";
    text = `waiting for ${missing.length || "some"} device(s)${missing.length ? `: ${missing.slice(0, 20).join(", ")}${missing.length > 20 ? ` and ${missing.length - 20} more` : ""}` : ""}${left}`;
  } else if (name === "stalled") {
    text = `stalled${c.reason ? `: ${c.reason}` : ""}`;
  } else if (name === "stopped" || name === "finished") {
    text = stopReason(s);
  } else if (name === "running" && state.lastRoundAt) {
    const quiet = Date.now() / 1000 - state.lastRoundAt;
    const timeout = Number(setting(s, "round_timeout")) || 0;
    if (timeout && quiet > 2 * timeout + 30) text = `no round has ended for ${duration(quiet)} (round timeout ${duration(timeout)}): a device may be missing`;
  }
  text = text || s.notice || "";
  $("banner").hidden = !text;
  $("banner").textContent = text;
  $("banner").className = `banner ${name}`;
}

function renderCards(s) {
  const online = s.fleet.filter((d) => d.online).length;
  $("card-online").textContent = `${online} / ${s.fleet.length + (s.fleet_left_out || 0)}`;
  const last = s.rounds[s.rounds.length - 1];
  $("card-answered").textContent = last ? `${last.participants} / ${last.selected}` : "-";
  const metric = s.devices.length ? s.devices[0].metric_name : (s.summary && s.summary.metric_name) || "metric";
  const final = s.summary && s.summary.metrics;
  const evaluated = [...s.rounds].reverse().find((r) => r.evaluation);
  const evaluation = final || (evaluated ? evaluated.evaluation : null);
  $("card-metric-label").textContent = `${final ? "final " : ""}personalized ${metric}`;
  $("card-global-label").textContent = final ? "final global model" : "global model";
  $("card-personalized").textContent = evaluation ? fmt(evaluation.personalized_mean) : "-";
  $("card-global").textContent = evaluation ? fmt(evaluation.global) : "-";
  const effect = s.summary && s.summary.personalization;
  const gains = [...resultsById(s).values()].filter((r) => present(r.gain));
  $("card-helped").textContent = effect ? `${effect.helped} of ${effect.devices}` : gains.length ? `${gains.filter((g) => g.gain > 0).length} of ${gains.length}` : "-";
  const total = s.summary ? s.summary.bytes_up + s.summary.bytes_down : s.rounds.reduce((sum, r) => sum + r.bytes_up + r.bytes_down, 0);
  $("card-bytes").textContent = bytes(total);
  const privacy = privacyOf(s);
  $("card-privacy").hidden = !privacy;
  if (privacy) {
    $("card-epsilon").textContent = `${fmt(privacy.spent, 2)} / ${present(privacy.budget) ? fmt(privacy.budget, 2) : "no budget"}`;
    $("card-delta").textContent = present(privacy.delta) ? `at delta ${privacy.delta}${privacy.final ? " (summary.json)" : ""}` : "";
  }
}

// What changed since the last snapshot, as events: the coordinator's own (when it publishes
// them) and what the page sees: state changes, devices going offline or quarantined, rounds
// with late or declining devices, refused messages.
function noteEvents(before, s) {
  const now = s.updated || s.now;
  const add = (level, text) => state.events.unshift({ at: now, level, text });
  for (const e of (s.coordinator && s.coordinator.events) || []) {
    const key = `${e.at}|${e.text}`;
    if (!state.seenEvents) state.seenEvents = new Set();
    if (!state.seenEvents.has(key)) { state.seenEvents.add(key); state.events.unshift({ at: e.at, level: e.level || "info", text: e.text }); }
  }
  if (!before) return;
  if (runState(before) !== runState(s)) add(runState(s) === "running" || runState(s) === "finished" ? "info" : "warn", `run ${runState(s)}${stopReason(s) ? `: ${stopReason(s)}` : ""}`);
  const was = new Map(before.fleet.map((d) => [d.device, d]));
  for (const d of s.fleet) {
    const old = was.get(d.device);
    if (!old) continue;
    if (old.online && !d.online) add("warn", `${d.device} went offline${d.detail ? `: ${d.detail}` : ""}`);
    if (!old.online && d.online) add("info", `${d.device} is back online`);
    if (!old.quarantined && d.quarantined) add("warn", `${d.device} quarantined (${d.dropped} messages dropped)`);
    if (!old.flapping && d.flapping) add("warn", `${d.device} is flapping: two devices may share its id`);
  }
  const seen = new Set(before.rounds.map((r) => r.round_id));
  for (const r of s.rounds.filter((r) => !seen.has(r.round_id))) {
    const late = Math.max(0, r.selected - r.participants - r.skipped);
    if (late || r.skipped) add("warn", `round ${r.round_id}: ${r.participants} of ${r.selected} answered${late ? `, ${late} late` : ""}${r.skipped ? `, ${r.skipped} declined` : ""}`);
  }
  if (s.refused > before.refused) add("warn", `${s.refused - before.refused} message(s) ignored: their topic may not carry them`);
  state.events.length = Math.min(state.events.length, MAX_EVENTS);
}

function renderEvents() {
  const items = state.events.map((e) => {
    const li = document.createElement("li");
    li.className = e.level;
    li.append(Object.assign(document.createElement("time"), { textContent: present(e.at) ? timeOfDay(e.at) : "" }), document.createTextNode(` ${e.text}`));
    return li;
  });
  $("events").replaceChildren(...items);
  $("events-count").textContent = state.events.length ? `(${state.events.length})` : "(none yet)";
}

function renderRounds(s) {
  const body = document.querySelector("#rounds tbody");
  const dp = Boolean(privacyOf(s));
  const key = JSON.stringify([dp, s.rounds.length ? s.rounds[s.rounds.length - 1] : null, s.rounds.length]);
  if (key === state.roundsDrawn) return; // the table shows these rounds already
  state.roundsDrawn = key;
  const rows = document.createDocumentFragment();
  for (const r of s.rounds.slice(-200).reverse()) {
    const tr = document.createElement("tr");
    const late = Math.max(0, r.selected - r.participants - r.skipped);
    const loss = dp && (!present(r.train_loss) || r.train_loss === 0) ? "n/r (DP)" : fmt(r.train_loss);
    for (const v of [r.round_id, r.selected, r.participants, r.skipped, late, r.dropped, loss, bytes(r.bytes_up), bytes(r.bytes_down), fmt(r.wall_seconds, 2)]) {
      tr.appendChild(Object.assign(document.createElement("td"), { textContent: String(v ?? "-") }));
    }
    rows.appendChild(tr);
  }
  body.replaceChildren(rows);
}

function renderSettings(s) {
  const all = $("settings-all").checked;
  const shown = all ? Object.entries(s.settings || {}).filter(([, v]) => v !== null && v !== "") : settingsInUse(s);
  const list = document.createDocumentFragment();
  for (const [key, value] of shown) {
    list.appendChild(Object.assign(document.createElement("dt"), { textContent: key }));
    list.appendChild(Object.assign(document.createElement("dd"), { textContent: String(value) }));
  }
  $("settings").replaceChildren(list);
}

function renderFleet(s) {
  setFleet(s, Boolean(privacyOf(s)));
  const more = s.fleet_left_out ? `, ${s.fleet_left_out} more not shown` : "";
  const refused = s.refused ? `; ${s.refused} messages ignored: their topic may not carry them` : "";
  $("fleet-count").textContent = `(${s.fleet.length} devices${more}${refused})`;
}

function render(snapshot) {
  const started = performance.now();
  const before = state.snapshot;
  if (before && snapshot.version < before.version && snapshot.source === before.source) return;
  if (!before || snapshot.rounds.length !== before.rounds.length) state.lastRoundAt = Date.now() / 1000;
  state.snapshot = snapshot;
  clock.offset = snapshot.now - Date.now() / 1000;
  noteEvents(before, snapshot);
  renderHeader(snapshot);
  renderBanner(snapshot);
  renderCards(snapshot);
  renderCharts(snapshot, state.overlay);
  renderFleet(snapshot);
  renderRounds(snapshot);
  renderSettings(snapshot);
  renderEvents();
  state.renders += 1;
  state.lastRenderMs = performance.now() - started;
  document.body.dataset.version = String(snapshot.version);
  document.body.dataset.state = runState(snapshot);
}

// The last snapshot with a delta applied; lists stay ordered by their id.
function applyDelta(delta) {
  const s = { ...state.snapshot, ...delta.set, now: delta.now };
  for (const key of delta.unset || []) delete s[key];
  for (const [name, change] of Object.entries(delta.lists || {})) {
    const ident = KEYED[name];
    const rows = new Map((s[name] || []).map((r) => [r[ident], r]));
    for (const id of change.remove) rows.delete(id);
    for (const row of change.upsert) rows.set(row[ident], row);
    s[name] = [...rows.values()].sort((a, b) => (a[ident] < b[ident] ? -1 : a[ident] > b[ident] ? 1 : 0));
  }
  return s;
}

// Time one pushed update takes on the main thread: parse, apply, render, style and layout.
function timed(handle) {
  return (e) => {
    const started = performance.now();
    handle(e);
    void document.body.offsetHeight; // the layout the render made, done now
    state.lastUpdateMs = performance.now() - started;
    state.updates += 1;
  };
}

function connect() {
  const events = new EventSource("api/events");
  events.addEventListener("snapshot", timed((e) => { state.snapshot = null; render(JSON.parse(e.data)); }));
  events.addEventListener("delta", timed((e) => state.snapshot && render(applyDelta(JSON.parse(e.data)))));
  events.onopen = () => { $("connection").textContent = "live"; $("connection").className = "badge live"; };
  events.onerror = () => {
    const over = state.snapshot && ["finished", "stopped"].includes(runState(state.snapshot));
    $("connection").textContent = over ? "run over, server gone" : "reconnecting";
    $("connection").className = "badge offline";
  };
}

// Other runs next to this one (a run directory's siblings), for the metric chart's overlay.
function loadRuns() {
  fetch("api/runs").then((r) => (r.ok ? r.json() : { runs: [] })).then((found) => {
    const select = $("overlay-run");
    for (const name of found.runs || []) select.appendChild(Object.assign(document.createElement("option"), { value: name, textContent: name }));
    $("overlay-controls").hidden = !(found.runs || []).length;
  }).catch(() => {});
  $("overlay-run").addEventListener("change", (e) => {
    const name = e.target.value;
    if (!name) { state.overlay = null; state.snapshot && render({ ...state.snapshot }); return; }
    fetch(`api/runs/${encodeURIComponent(name)}`).then((r) => r.json()).then((run) => { state.overlay = { name, rounds: run.rounds }; render({ ...state.snapshot }); }).catch(() => {});
  });
}

function setup() {
  setupFleet();
  $("x-axis").addEventListener("change", (e) => { charts.xAxis = e.target.value; state.snapshot && renderCharts(state.snapshot, state.overlay); });
  $("settings-all").addEventListener("change", () => state.snapshot && renderSettings(state.snapshot));
  $("csv-fleet").addEventListener("click", () => download("fleet.csv", fleetCsv()));
  $("csv-rounds").addEventListener("click", () => {
    const s = state.snapshot;
    if (!s) return;
    const keys = ["round_id", "selected", "participants", "skipped", "dropped", "train_loss", "bytes_up", "bytes_down", "wall_seconds"];
    const evaluation = [...new Set(s.rounds.flatMap((r) => Object.keys(r.evaluation || {})))];
    const scalars = [...new Set(s.rounds.flatMap((r) => Object.keys(r.scalars || {})))];
    download("rounds.csv", csv([[...keys, ...evaluation, ...scalars], ...s.rounds.map((r) => [...keys.map((k) => r[k]), ...evaluation.map((k) => (r.evaluation || {})[k]), ...scalars.map((k) => (r.scalars || {})[k])])]));
  });
  window.addEventListener("resize", () => { resizeCharts(); drawRows(); });
  setInterval(() => state.snapshot && (renderHeader(state.snapshot), renderBanner(state.snapshot), drawRows()), 5000); // ages, time left
  loadRuns();
  connect();
}

setup();
