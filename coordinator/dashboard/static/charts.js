// The page's charts (uPlot): they keep a zoom across updates, show the latest values in their
// captions, name the device under the cursor, and bin the per-device points of large fleets.
"use strict";

const charts = { plots: {}, zoomed: {}, xAxis: "round" };
const ROUND_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000];
const COLORS = ["#2f5bd3", "#1a7f4b", "#b54708", "#b42318", "#7a42c8", "#0e7490"];
const MAX_POINTS = 1500; // per-device points drawn as they are; beyond, binned
const HEIGHT = 220;

const chartWidth = (el) => Math.max(200, el.clientWidth);

function plot(id, series, data, extra = {}) {
  const el = $(id);
  const key = `${extra.yLabel || ""}|${extra.xLabel || ""}|${series.map((s) => s.label).join("|")}`;
  const existing = charts.plots[id];
  if (existing && existing.pflKey === key) {
    existing.setData(data, !charts.zoomed[id]); // a zoomed chart keeps its scales
    return existing;
  }
  if (existing) existing.destroy(); // its axes or series changed
  charts.zoomed[id] = false;
  const time = extra.xLabel === "clock time";
  const options = {
    width: chartWidth(el), height: HEIGHT,
    series: [{ label: extra.xLabel || "round", value: time ? (_, v) => (present(v) ? timeOfDay(v) : "-") : undefined }, ...series],
    scales: { x: { time } },
    axes: [{ label: extra.xLabel || "round", incrs: time ? undefined : ROUND_STEPS }, { label: extra.yLabel || "" }, ...(extra.axes || [])],
    legend: { live: true },
    cursor: { drag: { x: true, y: false } },
    hooks: {
      setSelect: [(u) => { if (u.select.width > 0) charts.zoomed[id] = true; }],
      ready: [(u) => u.over.addEventListener("dblclick", () => { charts.zoomed[id] = false; })],
      setCursor: extra.onCursor ? [extra.onCursor] : [],
    },
  };
  const made = new uPlot(options, data, el);
  made.pflKey = key;
  charts.plots[id] = made;
  return made;
}

const line = (label, i, more = {}) => ({ label, stroke: COLORS[i], width: 2, spanGaps: true, points: { show: true, size: 4 }, ...more });

// The x values of the round charts: round ids, or when each round ended (clock time) where the
// rounds carry it (`finished_at`), else the run's elapsed seconds summed from round wall times.
function xValues(rounds) {
  if (charts.xAxis !== "time") return { x: rounds.map((r) => r.round_id), label: "round" };
  if (rounds.length && rounds.every((r) => present(r.finished_at))) return { x: rounds.map((r) => r.finished_at), label: "clock time" };
  let elapsed = 0;
  return { x: rounds.map((r) => (elapsed += r.wall_seconds || 0)), label: "elapsed s" };
}

function latest(id, pairs) {
  const shown = pairs.filter(([, v]) => present(v)).map(([name, v, digits]) => `${name} ${typeof v === "number" ? fmt(v, digits ?? 3) : v}`);
  $(id).textContent = shown.length ? `latest: ${shown.join(" · ")}` : "";
}

function renderCharts(s, overlay) {
  const rounds = s.rounds;
  const { x, label } = xValues(rounds);
  const last = rounds[rounds.length - 1] || {};
  const ev = (key) => rounds.map((r) => (r.evaluation && present(r.evaluation[key]) ? r.evaluation[key] : null));
  const metric = s.devices.length ? s.devices[0].metric_name : "metric";
  const privacy = privacyOf(s);
  $("metric-caption").textContent = `Held-out ${metric} per round (device means)`;
  const metricSeries = [line("personalized", 0), line("global", 1), line("worst 10%", 2)];
  const metricData = [x, ev("personalized_mean"), ev("global"), ev("personalized_worst10")];
  if (overlay && charts.xAxis === "round") { // another run's personalized curve on the same rounds
    const theirs = new Map(overlay.rounds.map((r) => [r.round_id, r.evaluation ? r.evaluation.personalized_mean : null]));
    const xs = [...new Set([...x, ...theirs.keys()])].sort((a, b) => a - b);
    const ours = new Map(rounds.map((r, i) => [r.round_id, i]));
    metricData.splice(0, metricData.length, xs, ...metricData.slice(1).map((col) => xs.map((v) => (ours.has(v) ? col[ours.get(v)] : null))));
    metricSeries.push(line(`${overlay.name}: personalized`, 5, { dash: [6, 4] }));
    metricData.push(xs.map((v) => (theirs.has(v) ? theirs.get(v) : null)));
  }
  plot("chart-metric", metricSeries, metricData, { yLabel: metric, xLabel: label });
  const evaluated = [...rounds].reverse().find((r) => r.evaluation);
  latest("latest-metric", evaluated ? [["personalized", evaluated.evaluation.personalized_mean], ["global", evaluated.evaluation.global]] : []);

  const losses = rounds.map((r) => r.train_loss);
  const noLoss = Boolean(privacy) && !losses.some((v) => present(v) && v !== 0);
  $("loss-absent").hidden = !noLoss;
  $("chart-loss").hidden = noLoss;
  if (!noLoss) plot("chart-loss", [line("train loss", 0)], [x, losses], { yLabel: "loss", xLabel: label });
  latest("latest-loss", noLoss ? [] : [["loss", last.train_loss]]);

  $("privacy-figure").hidden = !privacy;
  if (privacy) {
    const budget = present(privacy.budget) ? rounds.map(() => privacy.budget) : rounds.map(() => null);
    plot("chart-epsilon", [line("epsilon spent", 4), line("budget", 3, { dash: [4, 4], points: { show: false } })], [x, privacy.curve, budget], { yLabel: "epsilon", xLabel: label });
    latest("latest-epsilon", [["spent", privacy.spent], ["budget", privacy.budget, 2]]);
  }

  const late = (r) => Math.max(0, r.selected - r.participants - r.skipped);
  plot(
    "chart-timeline",
    [line("selected", 0), line("answered", 1), line("declined", 2), line("late", 3), line("dropped msgs", 4)],
    [x, rounds.map((r) => r.selected), rounds.map((r) => r.participants), rounds.map((r) => r.skipped), rounds.map(late), rounds.map((r) => r.dropped)],
    { yLabel: "devices", xLabel: label },
  );
  latest("latest-timeline", [["answered", present(last.participants) ? `${last.participants} of ${last.selected}` : null]]);
  plot(
    "chart-bytes",
    [line("up KiB", 0), line("down KiB", 1), line("wall s", 2, { scale: "s" })],
    [x, rounds.map((r) => kib(r.bytes_up)), rounds.map((r) => kib(r.bytes_down)), rounds.map((r) => r.wall_seconds)],
    { yLabel: "KiB", xLabel: label, axes: [{ scale: "s", side: 1, label: "seconds", grid: { show: false } }] },
  );
  latest("latest-bytes", [["up", present(last.bytes_up) ? bytes(last.bytes_up) : null], ["down", present(last.bytes_down) ? bytes(last.bytes_down) : null], ["wall", last.wall_seconds, 2]]);
  renderGain(s, metric);
}

// Per-device gain against training samples; at scale, bins of equal device counts (their mean).
function renderGain(s, metric) {
  const results = resultsById(s);
  const points = [...results.entries()].filter(([, r]) => present(r.gain)).map(([id, r]) => ({ id, x: r.samples, y: r.gain })).sort((a, b) => a.x - b.x);
  let shown = points.map((p) => ({ x: p.x, y: p.y, name: p.id }));
  if (points.length > MAX_POINTS) {
    const size = Math.ceil(points.length / (MAX_POINTS / 5));
    shown = [];
    for (let i = 0; i < points.length; i += size) {
      const bin = points.slice(i, i + size);
      const mean = (f) => bin.reduce((sum, p) => sum + f(p), 0) / bin.length;
      shown.push({ x: mean((p) => p.x), y: mean((p) => p.y), name: `${bin.length} devices, ${bin[0].id} … ${bin[bin.length - 1].id} (mean)` });
    }
  }
  charts.gainNames = shown.map((p) => p.name);
  const binned = shown.length < points.length;
  plot(
    "chart-gain",
    [
      { label: binned ? "device gain (binned means)" : "device gain", stroke: COLORS[0], fill: COLORS[0], paths: () => null, points: { show: true, size: binned ? 5 : 7, fill: COLORS[0] }, value: (u, v, si, i) => (present(v) && present(i) ? `${fmt(v)} (${charts.gainNames[i]})` : "-") },
      { label: "no gain", stroke: "#999", width: 1, dash: [4, 4], points: { show: false } },
    ],
    [shown.map((p) => p.x), shown.map((p) => p.y), shown.map(() => 0)],
    {
      xLabel: "training samples", yLabel: `gain in ${metric}`,
      onCursor: (u) => {
        const i = u.cursor.idx;
        $("gain-hover").textContent = present(i) && charts.gainNames[i] ? `${charts.gainNames[i]}: gain ${fmt(u.data[1][i])}` : "";
      },
    },
  );
}

function resizeCharts() {
  for (const [id, made] of Object.entries(charts.plots)) if (!$(id).hidden) made.setSize({ width: chartWidth($(id)), height: HEIGHT });
}
