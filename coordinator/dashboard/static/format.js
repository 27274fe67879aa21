// Formatting and reading a snapshot: shared by the charts, the fleet table and the page.
"use strict";

const $ = (id) => document.getElementById(id);
const present = (v) => v !== null && v !== undefined && !(typeof v === "number" && Number.isNaN(v));
const fmt = (v, digits = 3) => (present(v) ? Number(v).toFixed(digits) : "-");
const kib = (b) => Math.round(b / 102.4) / 10;
const clock = { offset: 0 }; // the server's clock minus this browser's, in seconds

function bytes(n) {
  if (!n) return "0 B";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function ago(seconds) {
  if (!seconds) return "never";
  const s = Math.max(0, Date.now() / 1000 + clock.offset - seconds);
  if (s < 60) return `${s.toFixed(0)} s ago`;
  if (s < 3600) return `${(s / 60).toFixed(0)} min ago`;
  return `${(s / 3600).toFixed(1)} h ago`;
}

function duration(seconds) {
  if (!present(seconds)) return "-";
  const s = Math.max(0, seconds);
  if (s < 90) return `${s.toFixed(0)} s`;
  if (s < 5400) return `${(s / 60).toFixed(0)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

const timeOfDay = (epoch) => new Date(epoch * 1000).toLocaleTimeString();

// A setting by its flat name ("dp_noise") or its nested one ("dp.noise").
function setting(s, name) {
  const settings = s.settings || {};
  if (present(settings[name])) return settings[name];
  const nested = name.replace("_", ".");
  return present(settings[nested]) ? settings[nested] : null;
}

// Differential privacy as the snapshot shows it: null when the run has none.
function privacyOf(s) {
  const final = s.summary && s.summary.privacy;
  const curve = s.rounds.map((r) => (r.scalars && present(r.scalars.dp_epsilon) ? r.scalars.dp_epsilon : null));
  const lastSpent = [...curve].reverse().find(present);
  const noise = setting(s, "dp_noise");
  const live = s.scalars && present(s.scalars.dp_epsilon) ? s.scalars.dp_epsilon : null;
  if (!final && !present(lastSpent) && !present(noise) && !present(live)) return null;
  const spent = final && present(final.epsilon) ? final.epsilon : present(lastSpent) ? lastSpent : live;
  const budget = final && present(final.target_epsilon) ? final.target_epsilon : setting(s, "dp_epsilon");
  const delta = final && present(final.delta) ? final.delta : setting(s, "dp_delta");
  return { spent, budget, delta, curve, final: Boolean(final) };
}

// Settings a run uses: values set and not off (false, "none"), and none of a feature that is off (its switch is
// false, "none" or unset: `secagg`, `compress`, `dp_noise`, `mode` other than async...).
const FEATURE_SWITCHES = [
  { prefixes: ["dp_", "dp."], on: (s) => present(setting(s, "dp_noise")) },
  { prefixes: ["secagg_", "secagg."], on: (s) => setting(s, "secagg") === true || setting(s, "secagg.enabled") === true },
  { prefixes: ["buffer", "max_staleness", "staleness", "async."], on: (s) => setting(s, "mode") === "async" || setting(s, "async.enabled") === true },
  { prefixes: ["sim_", "sim."], on: simulatedClock },
  { prefixes: ["attack_", "malicious_"], on: (s) => ![null, "none"].includes(setting(s, "attack")) },
  { prefixes: ["export_"], on: (s) => present(setting(s, "export_dir")) },
];

// A simulated clock: async mode, a summary that reports simulated seconds, or a sim_ setting
// that asks for one (speeds, availability, dropouts, a deadline).
function simulatedClock(s) {
  if (setting(s, "mode") === "async" || present(s.summary && s.summary.sim_seconds)) return true;
  const asked = { speeds: "equal", availability: "always", uptime: 0, deadline: 0 };
  return Object.entries(asked).some(([name, off]) => present(setting(s, `sim_${name}`)) && setting(s, `sim_${name}`) !== off);
}

function settingsInUse(s) {
  const all = Object.entries(s.settings || {});
  return all.filter(([key, value]) => {
    if (value === null || value === "" || value === "none" || value === false) return false; // off
    const feature = FEATURE_SWITCHES.find((f) => f.prefixes.some((p) => key.startsWith(p)));
    return !feature || feature.on(s);
  });
}

// Per-device held-out results by id, with the gain personalization gave each.
function resultsById(s) {
  const higherIsBetter = !s.devices.length || s.devices[0].metric_name === "accuracy";
  const found = new Map();
  for (const d of s.devices) {
    const gain = present(d.global_model) ? (higherIsBetter ? d.personalized - d.global_model : d.global_model - d.personalized) : null;
    found.set(d.device_id, { metric: d.personalized, gain, samples: d.num_train_samples });
  }
  return found;
}

function csv(rows) {
  const quote = (v) => {
    const text = present(v) ? (typeof v === "object" ? JSON.stringify(v) : String(v)) : "";
    return /[",\n]/.test(text) ? `"${text.replaceAll('"', '""')}"` : text;
  };
  return rows.map((row) => row.map(quote).join(",")).join("\n") + "\n";
}

function download(name, text) {
  const link = document.createElement("a");
  link.href = URL.createObjectURL(new Blob([text], { type: "text/csv" }));
  link.download = name;
  document.body.appendChild(link);
  link.click();
  link.remove();
  setTimeout(() => URL.revokeObjectURL(link.href), 10_000);
}
