// The dlfleet dashboard: polls the master's /api/v1/status and /api/v1/events
// (same origin, the login cookie; the token never appears in a URL here) and
// keeps the history its charts draw in this page, so the master keeps none.
// Every string from the job is set as text, never parsed as HTML.
"use strict";

const POLL_MS = 1000;
const CHART_WINDOW_MS = 3 * 60 * 1000;
const HISTORY_MS = 10 * 60 * 1000;
const RATE_WINDOW_MS = 30 * 1000;
const GAP_MS = 5000; // a longer silence breaks a chart's line
const LOST_KEEP_MS = 10 * 60 * 1000;

const state = {
  openedAt: Date.now(), // the charts' time axis starts here until it is CHART_WINDOW_MS long
  nodes: new Map(), // name -> {card, history, doc, lostAt}
  datasets: new Map(), // name -> {row, history}
  jobRate: [], // [{t, v}] samples/s of the whole job
  goodputPhases: [], // [{t, cause}] what the job spent each poll on ("productive" or a cause)
  events: [],
  lastSeq: 0,
  lastOk: 0,
  failures: 0,
};

// ------------------------------------------------------------------ helpers

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") el.className = value;
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

function $(id) {
  return document.getElementById(id);
}

function setText(el, text) {
  const value = String(text);
  if (el.textContent !== value) el.textContent = value;
}

function num(value) {
  const n = Number(value);
  return Number.isFinite(n) ? n : 0;
}

function fmtInt(n) {
  return Math.round(num(n)).toLocaleString("en-US");
}

function fmtRate(n) {
  const v = num(n);
  if (v === 0) return "0";
  if (v >= 100) return fmtInt(v);
  if (v >= 10) return v.toFixed(1);
  return v.toFixed(2);
}

function fmtBytes(n) {
  let v = num(n);
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return `${v >= 10 || i === 0 ? v.toFixed(0) : v.toFixed(1)} ${units[i]}`;
}

function fmtDuration(seconds) {
  if (!Number.isFinite(seconds) || seconds < 0) return "–";
  const s = Math.round(seconds);
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m ${String(s % 60).padStart(2, "0")}s`;
  const hours = Math.floor(m / 60);
  if (hours < 48) return `${hours}h ${String(m % 60).padStart(2, "0")}m`;
  return `${Math.floor(hours / 24)}d ${hours % 24}h`;
}

function fmtClock(ms) {
  return new Date(ms).toLocaleTimeString("en-GB", { hour12: false });
}

function fmtAgo(ms, now) {
  const s = Math.max(0, (now - ms) / 1000);
  return s < 2 ? "just now" : `${fmtDuration(s)} ago`;
}

function fmtRanks(ranks) {
  if (!ranks || ranks.length === 0) return "none";
  const sorted = [...ranks].sort((a, b) => a - b);
  const first = sorted[0];
  const last = sorted[sorted.length - 1];
  const contiguous = last - first === sorted.length - 1;
  if (sorted.length === 1) return String(first);
  return contiguous ? `${first}–${last}` : sorted.join(", ");
}

function prune(history, now, keepMs) {
  while (history.length > 0 && history[0].t < now - keepMs) history.shift();
}

/** Records per second over the last RATE_WINDOW_MS of `history` ({t, v}),
 * from the last point before the count moved: a stretch at the window's start
 * where nothing was trained (the job starting, a round forming) is no part of
 * the pace, or a short job reads half the samples/s its nodes train. */
function rateOf(history) {
  if (history.length < 2) return null;
  const last = history[history.length - 1];
  let start = history.findIndex((point) => point.t >= last.t - RATE_WINDOW_MS);
  if (last.v !== history[start].v) {
    while (history[start + 1].v === history[start].v) start += 1;
  }
  const first = history[start];
  if (last.t - first.t < 1500) return null;
  return ((last.v - first.v) * 1000) / (last.t - first.t);
}

// ------------------------------------------------------------------ charts

const SVG = "http://www.w3.org/2000/svg";

function svg(tag, attrs) {
  const el = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) el.setAttribute(key, String(value));
  return el;
}

/** A chart's svg at the container's own size, and the time axis every chart
 * shares: from `start` (the window's left edge, or when the page opened) over
 * `span` ms to `now`. Null while the container is not laid out. */
function chartFrame(container, now) {
  const width = container.clientWidth;
  const height = container.clientHeight;
  if (width === 0 || height === 0) return null;
  const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}` });
  const start = Math.max(now - CHART_WINDOW_MS, state.openedAt);
  const span = Math.max(now - start, 10000);
  return { width, height, root, start, span };
}

/** A sparkline of `points` ({t, v}) over the last CHART_WINDOW_MS (or since
 * the page opened), drawn in the container's own pixels so that the line stays
 * crisp. Every chart has the same time axis. `marks` ({t, kind}) are events
 * drawn as vertical lines: failures, closed rounds. */
function sparkline(container, points, now, unit, marks = []) {
  const frame = chartFrame(container, now);
  if (frame === null) return;
  const { width, height, root, start, span } = frame;
  const shown = points.filter((p) => p.t >= start && p.v !== null);
  if (shown.length === 0) {
    const label = svg("text", { x: 0, y: height - 4, class: "nodata" });
    label.textContent = "waiting for data";
    root.append(label);
    container.replaceChildren(root);
    return;
  }
  const max = Math.max(...shown.map((p) => p.v)) || 1;
  const top = max * 1.15;
  const pad = 3;
  const x = (t) => ((t - (now - span)) / span) * (width - pad) + 0.5;
  const y = (v) => height - pad - (v / top) * (height - 2 * pad);
  // One line per run of points without a silence longer than GAP_MS.
  const runs = [];
  let run = [];
  for (const p of shown) {
    if (run.length > 0 && p.t - run[run.length - 1].t > GAP_MS) {
      runs.push(run);
      run = [];
    }
    run.push(p);
  }
  runs.push(run);
  for (const part of runs) {
    const line = part.map((p, i) => `${i ? "L" : "M"}${x(p.t).toFixed(1)},${y(p.v).toFixed(1)}`);
    const first = x(part[0].t).toFixed(1);
    const last = x(part[part.length - 1].t).toFixed(1);
    const base = (height - pad).toFixed(1);
    root.append(svg("path", { class: "area", d: `${line.join("")}L${last},${base}L${first},${base}Z` }));
    root.append(svg("path", { class: "line", d: line.join("") }));
  }
  for (const mark of marks) {
    if (mark.t < start || mark.t > now) continue;
    const at = x(mark.t).toFixed(1);
    root.append(svg("line", { class: `event ${mark.kind}`, x1: at, x2: at, y1: 0, y2: height - pad }));
  }
  const tip = shown[shown.length - 1];
  root.append(svg("circle", { class: "tip", cx: x(tip.t), cy: y(tip.v), r: 2.6 }));
  const title = svg("title", {});
  const low = Math.min(...shown.map((p) => p.v));
  title.textContent = `last ${fmtDuration(span / 1000)}: ${fmtRate(low)}–${fmtRate(max)} ${unit}`;
  root.append(title);
  container.replaceChildren(root);
}

// ------------------------------------------------------------------ header

function phaseClass(phase) {
  return { running: "run", succeeded: "good", failed: "bad" }[phase] || "";
}

function renderHeader(doc, now) {
  setText($("job-name"), doc.job_name || "job");
  const phase = $("job-phase");
  setText(phase, doc.phase || "unknown");
  phase.className = `pill ${phaseClass(doc.phase)}`;
  const round = num(doc.round);
  setText($("stat-round"), round > 0 ? fmtInt(round) : "forming");
  setText($("stat-world"), round > 0 ? fmtInt(doc.world_size) : "–");
  const inRound = (doc.nodes || []).filter((n) => (n.ranks || []).length > 0).length;
  setText($("stat-world-sub"), round > 0 ? `processes on ${inRound} node${inRound === 1 ? "" : "s"}` : "no active round");
  const live = doc.nodes ? doc.nodes.length : 0;
  setText($("stat-nodes"), fmtInt(live));
  const target = num(doc.target_nodes);
  const lost = [...state.nodes.values()].filter((n) => n.lostAt).length;
  const sub = [target > 0 ? `target ${target}` : "registered", lost ? `${lost} lost` : ""];
  setText($("stat-nodes-sub"), sub.filter(Boolean).join(" · "));
  setText($("stat-sps"), fmtRate(doc.samples_per_second));
  state.jobRate.push({ t: now, v: num(doc.samples_per_second) });
  prune(state.jobRate, now, HISTORY_MS);
  sparkline($("chart-sps"), state.jobRate, now, "samples/s", eventMarks(() => true));
}

/** The timeline's failures and closed rounds (of one node, or all) as chart marks. */
function eventMarks(concerns) {
  const kinds = { worker_failed: "bad", node_lost: "bad", round_closed: "warn" };
  return state.events
    .filter((e) => kinds[e.kind] && concerns(e))
    .map((e) => ({ t: e.at_ms, kind: kinds[e.kind] }));
}

// ------------------------------------------------------------------ datasets

// A dataset's records/s and ETA (null: not known yet). While it is the only
// one training, they are the job's own (samples/s and ETA from the master's
// status, as `dlmaster status` shows them): one rate and one ETA on the page.
// Otherwise, its records done over the last seconds.
function datasetPace(ds, doc, training, history) {
  const remaining = num(ds.records_total) - num(ds.records_done);
  if (remaining <= 0) return { rate: null, eta: 0 };
  const jobRate = num(doc.samples_per_second);
  if (training === 1 && jobRate > 0) {
    const told = doc.eta_seconds !== undefined && num(doc.eta_seconds) >= 0;
    return { rate: jobRate, eta: told ? num(doc.eta_seconds) : remaining / jobRate };
  }
  const rate = rateOf(history);
  return { rate, eta: rate !== null && rate > 0 ? remaining / rate : null };
}

function renderDatasets(doc, now) {
  const box = $("datasets");
  const datasets = doc.datasets || [];
  if (datasets.length === 0) return null;
  if (box.querySelector(".empty")) box.replaceChildren();
  let jobEta = 0;
  let known = true;
  const training = datasets.filter((ds) => num(ds.records_total) > num(ds.records_done)).length;
  for (const ds of datasets) {
    let entry = state.datasets.get(ds.name);
    if (!entry) {
      const fill = h("div", { class: "fill" });
      const epochs = h("div", { class: "epochs" });
      const bar = h("div", { class: "progress", role: "progressbar", "aria-valuemin": 0, "aria-label": ds.name }, fill, epochs);
      const parts = {
        name: h("span", { class: "name" }, ds.name),
        epoch: h("span", { class: "epoch" }),
        pct: h("span", { class: "pct" }),
        records: h("span", {}),
        rate: h("span", {}),
        failed: h("span", { class: "bad" }),
        eta: h("span", { class: "eta" }),
        bar,
        fill,
        epochs,
      };
      const row = h(
        "div",
        { class: "dataset", "data-dataset": ds.name },
        h("div", { class: "head" }, parts.name, parts.epoch, parts.pct),
        bar,
        h("div", { class: "foot" }, parts.records, parts.rate, parts.failed, parts.eta),
      );
      box.append(row);
      entry = { row, parts, history: [] };
      state.datasets.set(ds.name, entry);
    }
    const done = num(ds.records_done);
    const total = num(ds.records_total);
    entry.history.push({ t: now, v: done });
    prune(entry.history, now, HISTORY_MS);
    const { parts } = entry;
    const fraction = total > 0 ? Math.min(1, done / total) : 0;
    parts.fill.style.width = `${(fraction * 100).toFixed(2)}%`;
    parts.bar.setAttribute("aria-valuenow", String(done));
    parts.bar.setAttribute("aria-valuemax", String(total));
    parts.bar.classList.toggle("done", total > 0 && done >= total);
    const epochs = Math.max(1, num(ds.epochs));
    if (parts.epochs.childElementCount !== epochs && epochs <= 50) {
      parts.epochs.replaceChildren(...Array.from({ length: epochs }, () => h("span", {})));
    }
    setText(parts.pct, `${(fraction * 100).toFixed(1)}%`);
    const finished = total > 0 && done >= total;
    setText(parts.epoch, finished ? `${epochs} epoch${epochs === 1 ? "" : "s"}, done` : `epoch ${num(ds.epoch) + 1} of ${epochs}`);
    setText(parts.records, `${fmtInt(done)} / ${fmtInt(total)} records`);
    const { rate, eta } = datasetPace(ds, doc, training, entry.history);
    setText(parts.rate, rate !== null ? `${fmtRate(rate)} records/s` : "");
    setText(parts.failed, num(ds.failed_shards) > 0 ? `${ds.failed_shards} failed shards` : "");
    setText(parts.eta, finished ? "finished" : eta !== null ? `ETA ${fmtDuration(eta)}` : "ETA measuring…");
    if (eta === null) known = false;
    else jobEta = Math.max(jobEta, eta);
  }
  return known ? jobEta : null;
}

function renderEta(doc, localEta) {
  const fromMaster = num(doc.eta_seconds);
  if (doc.eta_seconds !== undefined && fromMaster >= 0 && doc.eta_seconds !== -1) {
    setText($("stat-eta"), fmtDuration(fromMaster));
    setText($("stat-eta-sub"), "from the master");
  } else if (localEta !== null && localEta !== undefined) {
    setText($("stat-eta"), localEta === 0 ? "done" : fmtDuration(localEta));
    setText($("stat-eta-sub"), localEta === 0 ? "every dataset finished" : "from the progress rate");
  } else {
    setText($("stat-eta"), "–");
    setText($("stat-eta-sub"), (doc.datasets || []).length ? "measuring the rate…" : "no dataset yet");
  }
}

// ------------------------------------------------------------------ nodes

function nodeCard(name) {
  const parts = {
    state: h("span", { class: "pill" }),
    id: h("span", { class: "id" }),
    facts: h("div", { class: "facts" }),
    sps: h("div", { class: "now" }),
    step: h("div", { class: "now" }),
    spsChart: h("div", { class: "chart" }),
    stepChart: h("div", { class: "chart violet" }),
  };
  const card = h(
    "article",
    { class: "node", "data-node": name },
    h("div", { class: "head" }, h("span", { class: "name" }, name), parts.id, parts.state),
    parts.facts,
    h(
      "div",
      { class: "metrics" },
      h("div", { class: "metric" }, h("div", { class: "label" }, "throughput"), parts.sps, parts.spsChart),
      h("div", { class: "metric" }, h("div", { class: "label" }, "step time"), parts.step, parts.stepChart),
    ),
  );
  return { card, parts, history: [], doc: null, lostAt: 0 };
}

function fact(label, value) {
  return h("span", {}, `${label} `, h("b", {}, value));
}

function renderNodes(doc, now) {
  const box = $("nodes");
  const seen = new Set();
  for (const node of doc.nodes || []) {
    seen.add(node.name);
    let entry = state.nodes.get(node.name);
    if (!entry) {
      entry = nodeCard(node.name);
      state.nodes.set(node.name, entry);
    }
    entry.lostAt = 0;
    entry.doc = node;
    const m = node.metrics;
    entry.history.push({
      t: now,
      sps: m ? num(m.samples_per_second) : null,
      step: m && num(m.step_time_ms) > 0 ? num(m.step_time_ms) : null,
    });
    prune(entry.history, now, HISTORY_MS);
  }
  for (const [name, entry] of state.nodes) {
    if (!seen.has(name) && !entry.lostAt) entry.lostAt = now;
    if (entry.lostAt && now - entry.lostAt > LOST_KEEP_MS) {
      entry.card.remove();
      state.nodes.delete(name);
    }
  }
  const order = [...state.nodes.entries()].sort(([a, ea], [b, eb]) => (!!ea.lostAt - !!eb.lostAt) || a.localeCompare(b, "en", { numeric: true }));
  if (order.length > 0 && box.querySelector(".empty")) box.replaceChildren();
  order.forEach(([, entry], i) => {
    if (box.children[i] !== entry.card) box.insertBefore(entry.card, box.children[i] || null);
    updateNode(entry, doc, now);
  });
}

function updateNode(entry, doc, now) {
  const { parts, doc: node } = entry;
  const ranks = node.ranks || [];
  let label;
  let tone;
  if (entry.lostAt) {
    label = "lost";
    tone = "lost";
  } else if (node.state && node.state !== "running") {
    label = node.state;
    tone = { succeeded: "", failed: "lost", lost: "lost", stopping: "waiting", starting: "waiting" }[node.state] ?? "waiting";
  } else if (ranks.length > 0 && num(doc.round) > 0) {
    label = "training";
    tone = "";
  } else {
    label = "waiting";
    tone = "waiting";
  }
  entry.card.className = `node ${tone}`.trim();
  entry.card.dataset.state = label;
  setText(parts.state, label);
  parts.state.className = `pill ${{ training: "good", lost: "bad", failed: "bad", succeeded: "good" }[label] || "warn"}`;
  setText(parts.id, node.node_id || "");
  const m = node.metrics;
  const facts = [fact(ranks.length > 1 ? "ranks" : "rank", fmtRanks(ranks))];
  if (m) {
    facts.push(fact("cpu", `${Math.round(num(m.cpu_percent))}%`));
    facts.push(fact("rss", fmtBytes(m.rss_bytes)));
    facts.push(fact("steps", fmtInt(m.steps)));
  }
  if (num(node.pid) > 0) facts.push(fact("pid", node.pid));
  if (num(node.relaunches) > 0) facts.push(fact("relaunches", node.relaunches));
  if (entry.lostAt) facts.push(fact("lost", fmtAgo(entry.lostAt, now)));
  if (node.detail) facts.push(h("span", {}, node.detail));
  parts.facts.replaceChildren(...facts);
  const live = !entry.lostAt && m;
  entry.card.dataset.samplesPerSecond = live ? String(num(m.samples_per_second)) : "0";
  parts.sps.replaceChildren(live ? fmtRate(m.samples_per_second) : "–", " ", h("small", {}, "samples/s"));
  const step = live && num(m.step_time_ms) > 0 ? fmtRate(m.step_time_ms) : "–";
  parts.step.replaceChildren(step, " ", h("small", {}, "ms"));
  const points = (key) => entry.history.map((p) => ({ t: p.t, v: p[key] }));
  const name = entry.card.dataset.node;
  const marks = eventMarks((e) => e.kind !== "round_closed" && String(e.node_id).split("#")[0] === name);
  sparkline(parts.spsChart, points("sps"), now, "samples/s", marks);
  sparkline(parts.stepChart, points("step"), now, "ms", marks);
}

// ------------------------------------------------------------------ failure, plan, checkpoints

function renderFailure(doc, now) {
  const box = $("failure");
  const f = doc.last_failure;
  if (!f) {
    if (!box.querySelector(".empty")) box.replaceChildren(h("p", { class: "empty" }, "No worker has failed."));
    return;
  }
  const key = JSON.stringify(f);
  const when = [...state.events].reverse().find((e) => e.kind === "worker_failed" && e.node_id === f.node_id);
  const ago = when ? fmtAgo(when.at_ms, now) : "";
  if (box.dataset.key === key) {
    const agoEl = box.querySelector(".ago");
    if (agoEl) setText(agoEl, ago);
    return;
  }
  box.dataset.key = key;
  const cause = f.signal ? `killed by ${f.signal}` : `exit code ${num(f.exit_code)}`;
  box.replaceChildren(
    h(
      "div",
      { class: "failure" },
      h(
        "div",
        { class: "summary" },
        h("span", { class: "pill bad" }, cause),
        h("span", {}, "node ", h("b", {}, f.node_id || "?")),
        h("span", {}, "rank ", h("b", {}, `${num(f.global_rank)}`), ` (local ${num(f.local_rank)})`),
        h("span", {}, "round ", h("b", {}, fmtInt(f.round))),
        h("span", {}, "restarts ", h("b", {}, fmtInt(f.restart_count))),
        h("span", { class: "ago" }, ago),
      ),
      f.rule
        ? h(
            "div",
            { class: "summary" },
            h("span", {}, "diagnosed ", h("b", {}, (f.category || "unknown").replace(/_/g, " "))),
            h("span", {}, "rule ", h("b", {}, f.rule)),
            h("span", {}, "action ", h("b", {}, (f.action || "").replace(/_/g, " "))),
          )
        : null,
      h("pre", {}, (f.message || "").trim() || "(no message: the process left no error file)"),
    ),
  );
}

function renderPlan(doc) {
  const box = $("plan");
  const plan = doc.last_plan || "";
  const key = `${plan}|${doc.target_nodes}`;
  if (box.dataset.key === key) return;
  box.dataset.key = key;
  if (!plan) {
    // A master run by `dlmaster --job-config` carries its supervisor's plan
    // (target_nodes set); a standalone master has no brain.
    const note = doc.target_nodes
      ? "The brain has not proposed anything yet: it plans once rounds have run long enough to measure."
      : "This master runs without a job supervisor, so without a brain.";
    box.replaceChildren(
      h("p", { class: "empty" }, "No plan yet."),
      h("div", { class: "plan" }, h("div", { class: "note" }, note)),
    );
    return;
  }
  const cut = plan.indexOf(": ");
  const what = cut > 0 ? plan.slice(0, cut) : plan;
  const why = cut > 0 ? plan.slice(cut + 2) : "";
  box.replaceChildren(
    h(
      "div",
      { class: "plan" },
      h("div", {}, h("b", {}, what)),
      why ? h("div", { class: "note" }, why) : null,
      num(doc.target_nodes) > 0 ? h("div", { class: "note" }, `target: ${doc.target_nodes} nodes`) : null,
    ),
  );
}

function step(value) {
  const n = num(value);
  return n < 0 ? "none" : fmtInt(n);
}

function renderCheckpoints(doc) {
  const c = doc.checkpoints;
  if (!c) return;
  const rows = [
    ["committed step", step(c.committed_step)],
    ["on two nodes", step(c.replicated_step ?? -1)],
    ["restorable step", step(c.restorable_step)],
    ["persisted step", step(c.persisted_step)],
    ["held in memory", fmtBytes(c.bytes_held)],
  ];
  const path = c.persisted_path || "";
  const parts = path.split("/").filter(Boolean);
  if (path) rows.push(["persisted to", parts.length > 2 ? `…/${parts.slice(-2).join("/")}` : path]);
  const key = JSON.stringify(rows) + path;
  const box = $("checkpoints");
  if (box.dataset.key === key) return;
  box.dataset.key = key;
  const items = rows.map(([k, v]) => [h("dt", {}, k), h("dd", { title: k === "persisted to" ? path : null }, v)]);
  box.replaceChildren(h("dl", { class: "kv" }, items));
}

// ------------------------------------------------------------------ goodput

// The ledger's parts in the order they are drawn: training first, then the
// causes of lost time (their CSS classes color the bar, the strip, the legend).
const GOODPUT_PARTS = [
  ["productive", "training"],
  ["restart", "restart"],
  ["hang_detection", "hang detection"],
  ["node_replacement", "node replacement"],
  ["re_rendezvous", "re-rendezvous"],
  ["waiting_for_nodes", "waiting for nodes"],
  ["checkpoint", "checkpoint"],
  ["rolled_back", "rolled back"],
  ["other", "other"],
];

function fmtSeconds(seconds) {
  return seconds < 60 ? `${seconds.toFixed(1)}s` : fmtDuration(seconds);
}

/** The window as one bar, each part as wide as its share of the time. */
function goodputBar(container, parts, total) {
  const width = container.clientWidth;
  const height = container.clientHeight;
  if (width === 0 || height === 0) return;
  const root = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}` });
  let x = 0;
  for (const [cause, label, seconds] of parts) {
    const w = (seconds / total) * width;
    const rect = svg("rect", { x: x.toFixed(2), y: 0, width: w.toFixed(2), height, class: `part cause-${cause}` });
    rect.dataset.cause = cause;
    const title = svg("title", {});
    title.textContent = `${label}: ${fmtSeconds(seconds)} (${((100 * seconds) / total).toFixed(1)}%)`;
    rect.append(title);
    root.append(rect);
    x += w;
  }
  container.replaceChildren(root);
}

/** What the job spent each poll on, over the charts' time axis. */
function goodputStrip(container, phases, now) {
  const frame = chartFrame(container, now);
  if (frame === null) return;
  const { width, height, root, start, span } = frame;
  const x = (t) => ((t - (now - span)) / span) * width;
  for (let i = 0; i + 1 < phases.length; i += 1) {
    const [from, to] = [phases[i], phases[i + 1]];
    if (to.t < start || to.t - from.t > GAP_MS) continue;
    const left = x(Math.max(from.t, start));
    root.append(svg("rect", { x: left.toFixed(2), y: 0, width: (x(to.t) - left).toFixed(2), height, class: `part cause-${to.cause}` }));
  }
  container.replaceChildren(root);
}

function renderGoodput(doc, now) {
  const g = doc.goodput;
  const total = g ? num(g.window_seconds) : 0;
  if (!g || total <= 0) return;
  const seconds = { productive: num(g.productive_seconds) };
  for (const lost of g.badput || []) seconds[lost.cause] = num(lost.seconds);
  // Parts under a twentieth of a second would show as "0.0s".
  const parts = GOODPUT_PARTS.filter(([cause]) => seconds[cause] >= 0.05).map(([cause, label]) => [cause, label, seconds[cause]]);
  state.goodputPhases.push({ t: now, cause: g.phase || "productive" });
  prune(state.goodputPhases, now, HISTORY_MS);
  const box = $("goodput-bar").closest(".goodput");
  box.dataset.ratio = String(num(g.ratio));
  box.dataset.phase = g.phase || "productive";
  setText($("goodput-ratio"), `${(100 * num(g.ratio)).toFixed(1)}%`);
  const lost = total - seconds.productive;
  setText($("goodput-sub"), `of ${fmtSeconds(total)} since the first step went into training steps; ${fmtSeconds(lost)} lost`);
  goodputBar($("goodput-bar"), parts, total);
  goodputStrip($("goodput-strip"), state.goodputPhases, now);
  const key = JSON.stringify(parts.map(([cause, , s]) => [cause, s.toFixed(1)]));
  const legend = $("goodput-legend");
  if (legend.dataset.key === key) return;
  legend.dataset.key = key;
  legend.replaceChildren(
    ...parts.map(([cause, label, s]) =>
      h("li", { "data-cause": cause }, h("span", { class: `swatch cause-${cause}` }), `${label} `, h("b", {}, fmtSeconds(s))),
    ),
  );
}

// ------------------------------------------------------------------ timeline

function describe(e) {
  const incarnation = (id) => Number(String(id || "").split("#")[1] || 0);
  switch (e.kind) {
    case "round_formed":
      return [`Round ${e.round} formed`, `world ${e.world_size}: ${(e.nodes || []).join(", ")}`, "round_formed"];
    case "round_closed":
      return [`Round ${e.round} closed`, e.reason || "", "round_closed"];
    case "node_registered":
      if (incarnation(e.node_id) > 1) {
        return [`${e.node_id} restarted`, `incarnation ${incarnation(e.node_id)} on ${e.host || "?"}`, "node_restarted"];
      }
      return [`${e.node_id} joined`, `${e.host || "?"} · ${e.local_world_size} process${e.local_world_size === 1 ? "" : "es"}`, "node_registered"];
    case "node_lost":
      return [`${e.node_id} lost`, e.reason || "", "node_lost"];
    case "worker_failed": {
      // The signal, the reason's label and the message often say the same.
      const bits = [];
      for (const bit of [e.signal || `exit ${e.exit_code}`, e.reason, e.message]) {
        const low = String(bit || "").toLowerCase();
        if (!low || bits.some((said) => said.toLowerCase().includes(low))) continue;
        const shorter = bits.findIndex((said) => low.includes(said.toLowerCase()));
        if (shorter >= 0) bits[shorter] = String(bit);
        else bits.push(String(bit));
      }
      if (e.rule) bits.push(`${String(e.category || "").replace(/_/g, " ")} (rule ${e.rule}): ${String(e.action || "").replace(/_/g, " ")}`);
      bits.push(`restart ${e.restart_count}`);
      return [`Worker failed on ${e.node_id} (rank ${e.global_rank})`, bits.join(" · "), "worker_failed"];
    }
    case "brain_plan":
      return ["Brain plan", e.plan || "", "brain_plan"];
    case "node_retired":
      return [`${e.node} retired as faulty`, e.detail || "replaced by a fresh node", "node_lost"];
    case "node_checked":
      if (e.verdict === "faulty") {
        return [`${e.node_id} failed its node check`, `${e.rule}: ${e.reason || ""}`, "node_lost"];
      }
      return [`${e.node_id} passed its node check`, `${(e.took_ms / 1000).toFixed(1)} s · ${e.reason || ""}`, "node_registered"];
    default:
      return [e.kind, "", ""];
  }
}

function renderTimeline(fresh, reset) {
  const list = $("timeline");
  if (reset) list.replaceChildren();
  if (fresh.length === 0) return;
  if (list.querySelector(".empty")) list.replaceChildren();
  for (const e of fresh) {
    const [what, why, kind] = describe(e);
    const item = h(
      "li",
      { class: `event ${kind}`, "data-kind": e.kind, "data-seq": e.seq },
      h("span", { class: "mark" }),
      h("div", {}, h("div", { class: "what" }, what), why ? h("div", { class: "why" }, why) : null),
      h("time", { datetime: new Date(e.at_ms).toISOString() }, fmtClock(e.at_ms)),
    );
    list.prepend(item); // newest first
  }
  while (list.childElementCount > 500) list.lastElementChild.remove();
}

// ------------------------------------------------------------------ polling

class Unauthorized extends Error {}

async function getJson(path) {
  const answer = await fetch(path, {
    credentials: "same-origin",
    cache: "no-store",
    headers: { Accept: "application/json" },
  });
  if (answer.status === 401) throw new Unauthorized();
  if (!answer.ok) throw new Error(`${path}: HTTP ${answer.status}`);
  return answer.json();
}

function showBanner(text) {
  const banner = $("banner");
  banner.hidden = !text;
  setText(banner, text || "");
}

function setLive(ok, text) {
  $("live").className = `live ${ok ? "ok" : "down"}`;
  setText($("live-text"), text);
}

async function poll() {
  const now = Date.now();
  let doc;
  let events;
  try {
    [doc, events] = await Promise.all([
      getJson("/api/v1/status"),
      getJson(`/api/v1/events?since=${state.lastSeq}`),
    ]);
  } catch (error) {
    state.failures += 1;
    if (error instanceof Unauthorized) {
      showBanner("Not logged in, or the job's token changed: open the login link that dlmaster printed (…/login?token=…) again.");
      setLive(false, "logged out");
    } else {
      const since = state.lastOk ? ` since ${fmtClock(state.lastOk)}` : "";
      showBanner(`The master does not answer${since}; showing the last state it sent. Retrying…`);
      setLive(false, "disconnected");
    }
    const delay = Math.min(POLL_MS * 2 ** Math.max(0, state.failures - 3), 10000);
    window.setTimeout(poll, delay);
    return;
  }
  // Polled on, whatever the rendering below does.
  window.setTimeout(poll, POLL_MS);
  // A last_seq below what was asked for: a new master, a new timeline.
  const reset = events.last_seq < state.lastSeq;
  if (reset) state.events = [];
  state.events.push(...events.events);
  if (state.events.length > 1000) state.events.splice(0, state.events.length - 1000);
  state.lastSeq = events.last_seq;
  state.lastOk = now;
  state.failures = 0;
  showBanner("");
  setLive(true, `live · ${fmtClock(now)}`);
  render(doc, events.events, reset, now);
}

function render(doc, fresh, reset, now) {
  renderHeader(doc, now);
  const localEta = renderDatasets(doc, now);
  renderEta(doc, localEta);
  renderNodes(doc, now);
  renderTimeline(fresh, reset);
  renderFailure(doc, now);
  renderPlan(doc);
  renderCheckpoints(doc);
  renderGoodput(doc, now);
  const progress = (doc.datasets || []).map((d) => num(d.records_done) / Math.max(1, num(d.records_total)));
  const pct = progress.length ? ` · ${Math.round((100 * progress.reduce((a, b) => a + b, 0)) / progress.length)}%` : "";
  document.title = `${doc.job_name || "job"} · ${doc.phase || "?"}${pct} — dlfleet`;
}

document.addEventListener("DOMContentLoaded", () => {
  setText($("master-url"), `master ${window.location.host}`);
  poll();
});
