// The status page: polls /api/status every 2 s and draws it. Plain DOM and uPlot (vendored).
"use strict";

const charts = {};          // query name -> {durations, lag} uPlot instances
const lagHistory = {};      // query name -> {times: [], series: {"topic-p": []}}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "class") node.className = value; else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function fmt(value, digits) {
  if (value === null || value === undefined) return "–";
  if (typeof value === "number" && digits !== undefined) return value.toFixed(digits);
  return typeof value === "number" ? value.toLocaleString("en") : String(value);
}

function age(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds < 90) return seconds.toFixed(1) + " s";
  if (seconds < 5400) return (seconds / 60).toFixed(1) + " min";
  return (seconds / 3600).toFixed(1) + " h";
}

function table(headers, rows) {
  return el("table", {}, el("thead", {}, el("tr", {}, ...headers.map(h => el("th", {}, h)))),
            el("tbody", {}, ...rows));
}

function figure(label, value, attrs) {
  return el("div", Object.assign({class: "figure"}, attrs || {}), el("b", {}, value), label);
}

// Charts' axes: uPlot draws tick labels on its canvas, right-aligned against the plot, in a space
// of fixed width unless told otherwise, so a wide label loses its leading digits. Each value axis
// here is sized from its widest label, and counts are written short (21k).
const AXIS_FONT = '12px system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif';
const measureContext = document.createElement("canvas").getContext("2d");
const MIN_LAG_WINDOW_S = 60;
// Tick steps for counts of records: whole numbers only (1, 2, 5, 10, 20, 25, 50, ...).
const COUNT_INCRS = [1, 2, 5, ...Array.from({length: 12}, (_, e) => [1, 2, 2.5, 5].map(m => m * 10 ** (e + 1))).flat()];

function textWidth(text) {
  measureContext.font = AXIS_FONT;
  return measureContext.measureText(text).width;
}

// uPlot's axis `size`: the widest label (CSS px) plus the axis's tick length and gap.
function axisSize(u, values, axisIdx) {
  const axis = u.axes[axisIdx];
  const widest = Math.max(0, ...(values || []).filter(v => v !== null).map(v => textWidth(String(v))));
  return Math.ceil(Math.max(30, widest + (axis.ticks.show ? axis.ticks.size : 0) + axis.gap + 2));
}

function compact(value) {
  const abs = Math.abs(value);
  for (const [unit, suffix] of [[1e9, "G"], [1e6, "M"], [1e3, "k"]]) {
    if (abs >= unit) return String(+(value / unit).toFixed(2)) + suffix;
  }
  return value.toLocaleString("en", {maximumFractionDigits: 3});
}

function clock(seconds) {
  const at = new Date(seconds * 1000);
  return [at.getHours(), at.getMinutes(), at.getSeconds()].map(n => String(n).padStart(2, "0")).join(":");
}

// An axis's `values`: its labels, also kept on the chart's root (data-<key>) as drawn, for tests.
function tickLabels(key, format) {
  return (u, splits) => {
    const out = splits.map(format);
    u.root.dataset[key] = JSON.stringify(out);
    return out;
  };
}

function valueAxis(extra) {
  return Object.assign({font: AXIS_FONT, size: axisSize, values: tickLabels("yTicks", compact)}, extra);
}

// The lag chart's time range: at least MIN_LAG_WINDOW_S, ending at the newest sample. Left to
// itself, uPlot widens a single sample's time range by a day in milliseconds, which for
// timestamps in seconds (ours) is 86,400,000 s: years.
function lagWindow(u, min, max) {
  const times = u.data[0];
  if (!times.length || min === null) return [min, max];
  const last = times[times.length - 1];
  return last - times[0] < MIN_LAG_WINDOW_S ? [last - MIN_LAG_WINDOW_S, last] : [min, max];
}

// Lag counts from 0 to a round value above the largest (10 when all are 0).
function fromZero(u, min, max) {
  if (max === null) return [null, null];
  const top = Math.max(max, 0) * 1.1;
  if (top <= 0) return [0, 10];
  const magnitude = Math.pow(10, Math.floor(Math.log10(top)));
  return [0, [1, 2, 2.5, 5, 10].map(m => m * magnitude).find(v => v >= top)];
}

function plot(holder, name, title, series, data) {
  const opts = {
    title, width: 520, height: 200,
    scales: {x: {time: false}},
    series: [{label: "batch"}, ...series],
    axes: [{label: "batch", font: AXIS_FONT}, valueAxis({scale: series[0].scale, label: series[0].label}),
           ...(series[1] && series[1].scale !== series[0].scale
             ? [valueAxis({scale: series[1].scale, side: 1, label: series[1].label, grid: {show: false}, values: tickLabels("y2Ticks", compact)})]
             : [])],
  };
  if (!charts[name]) {
    charts[name] = new uPlot(opts, data, holder);
  } else {
    holder.append(charts[name].root);
    charts[name].setData(data);
  }
}

function lagPlot(holder, query, takenAt) {
  const key = query.name;
  const history = lagHistory[key] || (lagHistory[key] = {times: [], series: {}});
  const last = history.times[history.times.length - 1];
  if (last !== takenAt) {
    history.times.push(takenAt);
    for (const p of query.partitions) {
      const label = p.topic + "-" + p.partition;
      const values = history.series[label] || (history.series[label] = new Array(history.times.length - 1).fill(null));
      values.push(p.lag);
    }
    for (const values of Object.values(history.series)) {
      while (values.length < history.times.length) values.push(null);
    }
    if (history.times.length > 300) {
      history.times.shift();
      for (const values of Object.values(history.series)) values.shift();
    }
  }
  const names = Object.keys(history.series).sort();
  const chartKey = "lag:" + key + ":" + names.join(",");
  const colors = ["#1565c0", "#ef6c00", "#2e7d32", "#6a1b9a", "#00838f", "#ad1457"];
  const data = [history.times.slice(), ...names.map(l => history.series[l].slice())];
  if (!charts[chartKey]) {
    charts[chartKey] = new uPlot({
      title: "source lag per partition (records)", width: 520, height: 200,
      scales: {x: {time: true, range: lagWindow}, y: {range: fromZero}},
      series: [{}, ...names.map((l, i) => ({label: l, stroke: colors[i % colors.length]}))],
      axes: [{font: AXIS_FONT, space: 70, values: tickLabels("xTicks", clock)}, valueAxis({incrs: COUNT_INCRS})],
      hooks: {draw: [u => Object.assign(u.root.dataset, {xMin: u.scales.x.min, xMax: u.scales.x.max, yMax: u.scales.y.max,
                                                         axisFont: AXIS_FONT})]},
    }, data, holder);
  } else {
    holder.append(charts[chartKey].root);
    charts[chartKey].setData(data);
  }
}

// A fan-out target's "committed" cell, by its commit mode (the snapshot's TargetStatus.commit_mode).
function targetCommitted(target) {
  if (target.commit_mode === "task") return "committed by its tasks";
  const counted = fmt(target.committed_committables) + (target.committed_committables === 1 ? " committable, " : " committables, ")
    + fmt(target.committed_rows) + " rows";
  if (target.commit_mode === "checkpoint-complete") {
    return (target.committed_committables ? counted : "none yet") + ", by the driver on checkpoint-complete";
  }
  return target.committed_committables ? counted : "–";
}

function queryCard(query, snapshot) {
  const thresholds = snapshot.thresholds;
  const card = el("section", {class: "card query", "data-query": query.name});
  card.append(el("h2", {}, "query " + query.name, " ", el("span", {class: "muted"}, query.checkpoint)));
  if (query.error) card.append(el("div", {class: "red"}, "checkpoint unreadable: " + query.error));
  const lastDone = [...query.batches].reverse().find(b => b.completed_at !== null);
  const stalledLately = query.stalls_recent.length > 0
    && snapshot.taken_at - query.stalls_recent[0].at < thresholds.stall_alert_s;
  card.append(el("div", {class: "figures"},
    figure("last planned batch", fmt(query.last_planned), {"data-testid": "last-planned"}),
    figure("last completed batch", fmt(query.last_completed), {"data-testid": "last-completed"}),
    figure("completed batches", fmt(query.completed_batches), {"data-testid": "completed-batches"}),
    figure("last batch duration", lastDone ? age(lastDone.duration_s) : "–"),
    figure("records in last batch", lastDone ? fmt(lastDone.records) : "–"),
    figure("source lag (records)" + (query.lag_growing ? ", growing" : ""), fmt(query.lag_records),
           query.lag_growing ? {class: "figure red"} : {}),
    figure("restarts", fmt(query.restarts.length)),
    figure("stalls", fmt(query.stalls), stalledLately ? {class: "figure red", "data-testid": "stalls"}
                                                      : {"data-testid": "stalls"})));
  const charts = el("div", {class: "charts"});
  const durationHolder = el("div", {"data-testid": "duration-chart"});
  const lagHolder = el("div", {"data-testid": "lag-chart"});
  charts.append(durationHolder, lagHolder);
  card.append(charts);
  const done = query.batches.filter(b => b.duration_s !== null);
  plot(durationHolder, "duration:" + query.name, "batch duration (s) and records per batch", [
    {label: "duration s", scale: "s", stroke: "#1565c0", width: 2},
    {label: "records", scale: "n", stroke: "#ef6c00", width: 1},
  ], [done.map(b => b.batch_id), done.map(b => b.duration_s), done.map(b => b.records)]);
  lagPlot(lagHolder, query, snapshot.taken_at);

  card.append(el("h3", {}, "sinks"));
  const sinkRows = [];
  for (const sink of query.sinks) {
    const oldest = sink.pending.length ? Math.max(...sink.pending.map(p => p.age_s)) : null;
    const red = sink.pending.some(p => p.red);
    sinkRows.push(el("tr", {class: red ? "red" : "", "data-sink": sink.sink_id},
      el("td", {}, sink.sink_id), el("td", {}, sink.protocol), el("td", {}, fmt(sink.journaled)),
      el("td", {}, fmt(sink.committed)), el("td", {}, fmt(sink.last_committed)),
      el("td", {}, fmt(sink.commit_lag_batches)), el("td", {}, age(sink.commit_latency_s)),
      el("td", {}, sink.pending.map(p => "batch " + p.batch_id + " (" + age(p.age_s) + (p.completed ? ", complete" : "") + ")").join(", ") || "none"),
      el("td", {}, age(oldest)), el("td", {}, fmt(sink.aborted_total))));
    for (const target of sink.targets) {
      sinkRows.push(el("tr", {class: "muted target", "data-target": target.sink_id, "data-commit-mode": target.commit_mode},
        el("td", {}, "  → " + target.sink_id), el("td", {}, target.protocol),
        el("td", {}, ""), el("td", {class: "committed"}, targetCommitted(target)),
        el("td", {}), el("td", {}), el("td", {}), el("td", {}), el("td", {}), el("td", {})));
    }
  }
  card.append(table(["sink", "protocol", "journaled", "committed", "last committed", "commit lag (batches)",
                     "checkpoint → committed", "not yet committed", "oldest", "aborted (seen)"], sinkRows));
  const aborts = query.sinks.flatMap(sink => sink.aborted.map(a => ({sink: sink.sink_id, ...a})));
  if (aborts.length) {
    card.append(el("h3", {}, "recoveries seen: batches aborted or re-run"));
    card.append(table(["at", "sink", "batch", "what"], aborts.map(a => el("tr", {},
      el("td", {}, new Date(a.seen_at * 1000).toLocaleTimeString()), el("td", {}, a.sink), el("td", {}, a.batch_id),
      el("td", {}, a.how)))));
  }

  card.append(el("h3", {}, "Kafka source partitions"));
  card.append(table(["topic", "partition", "end offset", "stable offset", "planned", "completed", "lag"],
    query.partitions.map(p => el("tr", {"data-partition": p.topic + "-" + p.partition},
      el("td", {}, p.topic), el("td", {}, p.partition), el("td", {}, fmt(p.end_offset)), el("td", {}, fmt(p.stable_offset)),
      el("td", {}, fmt(p.planned_offset)), el("td", {}, fmt(p.completed_offset)),
      el("td", {class: query.lag_growing ? "red" : ""}, fmt(p.lag))))));
  if (query.stalls_recent.length) {
    card.append(el("h3", {}, "stalls (batch watchdog)"));
    card.append(table(["at", "batch", "waited", "what"], query.stalls_recent.map(s =>
      el("tr", {}, el("td", {}, new Date(s.at * 1000).toLocaleTimeString()), el("td", {}, s.batch),
         el("td", {}, age(s.waited_s)), el("td", {}, s.message)))));
  }
  if (query.restarts.length) {
    card.append(el("h3", {}, "restarts"));
    card.append(table(["at", "cause"], query.restarts.map(r =>
      el("tr", {}, el("td", {}, new Date(r.at * 1000).toLocaleTimeString()), el("td", {}, r.cause)))));
  }
  return card;
}

function render(snapshot) {
  if (snapshot.taken_at === null) return;
  const verdict = document.getElementById("verdict");
  const risk = snapshot.alerts.length > 0;
  verdict.textContent = risk ? "AT RISK: " + snapshot.alerts.length + " red" : "OK";
  verdict.className = "verdict " + (risk ? "red" : "ok");
  document.getElementById("taken-at").textContent = "as of " + new Date(snapshot.taken_at * 1000).toLocaleTimeString();
  document.getElementById("alerts").replaceChildren(...snapshot.alerts.map(a => el("div", {"data-kind": a.kind}, a.message)));
  document.getElementById("errors").replaceChildren(...Object.entries(snapshot.errors).map(([k, v]) => el("div", {}, k + ": " + v)));
  document.getElementById("queries").replaceChildren(...snapshot.queries.map(q => queryCard(q, snapshot)));

  const prepared = document.querySelector("#prepared tbody");
  prepared.replaceChildren(...(snapshot.prepared === null
    ? [el("tr", {}, el("td", {colspan: 9, class: "muted"}, "PostgreSQL not asked (no DSN) or unreachable"))]
    : snapshot.prepared.length === 0 ? [el("tr", {}, el("td", {colspan: 9, class: "muted"}, "none"))]
    : snapshot.prepared.map(t => el("tr", {class: "prepared" + (t.red ? " red" : ""), "data-gid": t.gid},
        el("td", {}, t.gid), el("td", {}, fmt(t.sink_id)), el("td", {}, fmt(t.batch_id)), el("td", {}, fmt(t.partition_id)),
        el("td", {}, fmt(t.query)), el("td", {}, t.state), el("td", {class: "age"}, age(t.age_s)),
        el("td", {}, fmt(t.locks)), el("td", {}, t.relations.join(", "))))));

  const kafka = document.querySelector("#kafka-transactions tbody");
  document.getElementById("kafka-asked").textContent = snapshot.kafka_transactions_at
    ? "asked the broker " + age(snapshot.taken_at - snapshot.kafka_transactions_at) + " ago" : "";
  kafka.replaceChildren(...(snapshot.kafka_transactions === null
    ? [el("tr", {}, el("td", {colspan: 5, class: "muted"}, "Kafka not asked (no bootstrap) or unreachable"))]
    : snapshot.kafka_transactions.length === 0 ? [el("tr", {}, el("td", {colspan: 5, class: "muted"}, "none"))]
    : snapshot.kafka_transactions.map(t => el("tr", {class: "kafka-transaction" + (t.red ? " red" : ""), "data-id": t.transactional_id},
        el("td", {}, t.transactional_id), el("td", {}, t.state), el("td", {class: "age"}, age(t.age_s)),
        el("td", {}, age(t.timeout_s)), el("td", {}, t.partitions.join(", "))))));
}

async function refresh() {
  try {
    const response = await fetch("/api/status", {cache: "no-store"});
    render(await response.json());
  } catch (error) {
    document.getElementById("verdict").textContent = "page cannot reach its server";
    document.getElementById("verdict").className = "verdict red";
  }
}

refresh();
setInterval(refresh, 2000);
