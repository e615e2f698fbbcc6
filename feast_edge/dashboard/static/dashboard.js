// The feast-edge dashboard page: renders the server's snapshot (api/state, api/events) into the sections of index.html.
//
// Device names, reasons and labels come from the network: they reach the DOM only through
// textContent and setAttribute, never as markup. URLs are relative, so a reverse-proxy prefix works.
"use strict";

(function () {
  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
  const POLL_MS = 2000;
  const SERVED_CHARS = 160; // the header's served line; longer reasons are cut between words, whole in its tooltip
  // Tick steps of a round axis: whole rounds only (uPlot's defaults also step by 0.5 or 0.2 between them).
  const ROUND_STEPS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 2500, 5000, 10000, 20000, 50000, 100000];
  const ENDED = ["finished", "failed", "stopped"];
  const charts = {}; // chart id -> {plot, layout, data}
  let current = null; // the last snapshot
  let clockOffset = 0; // server clock minus this browser's clock, in seconds
  let polling = null;

  // ------------------------------------------------------------------ small helpers
  function byId(id) {
    return document.getElementById(id);
  }

  function text(node, value) {
    node.textContent = value === null || value === undefined || value === "" ? "–" : String(value);
    return node;
  }

  function cell(row, value, className, title) {
    const td = document.createElement("td");
    text(td, value);
    if (className) td.className = className;
    if (title) td.setAttribute("title", title);
    row.appendChild(td);
    return td;
  }

  function isNumber(value) {
    return typeof value === "number" && isFinite(value);
  }

  function fixed(value, scale, digits) {
    return isNumber(value) ? (value / scale).toFixed(digits) : null;
  }

  function percent(value) {
    return isNumber(value) ? (100 * value).toFixed(2) : null;
  }

  function count(n) {
    if (!isNumber(n)) return null;
    for (const [scale, unit] of [[1e9, "G"], [1e6, "M"], [1e3, "K"]]) {
      if (Math.abs(n) >= scale) return (n / scale).toPrecision(3) + unit;
    }
    return String(Math.round(n));
  }

  function ago(seconds) {
    for (const [unit, size] of [["d", 86400], ["h", 3600], ["min", 60]]) {
      if (seconds >= 1.5 * size) return Math.round(seconds / size) + " " + unit + " ago";
    }
    return Math.max(0, Math.round(seconds)) + " s ago";
  }

  function serverNow() {
    return Date.now() / 1000 + clockOffset;
  }

  function replaceRows(tbody, rows) {
    tbody.replaceChildren(...rows);
  }

  function plural(n, noun) {
    return n + " " + noun + (n === 1 ? "" : "s");
  }

  // words whole where they fit in limit characters, else cut after the last whole word that fits, with "…" (mid-word
  // only where that would drop more than a quarter of limit: a very long word); feast_edge.util.text.shortened.
  function shortened(words, limit) {
    if (words.length <= limit) return words;
    const cut = words.slice(0, limit - 1);
    const space = cut.lastIndexOf(" ");
    return (space >= Math.floor((3 * limit) / 4) ? cut.slice(0, space) : cut).replace(/[ ,;:]+$/, "") + "…";
  }

  function ended(s) {
    return Boolean(s.run) && ENDED.includes(s.run.status);
  }

  // The last round the run completed: its record's count, else its history's last round (null before any).
  function lastRound(s) {
    const run = s.run || {};
    if (isNumber(run.rounds_done) && run.rounds_done > 0) return run.rounds_done;
    return s.history.length && isNumber(s.history[s.history.length - 1].round) ? s.history[s.history.length - 1].round : null;
  }

  // ------------------------------------------------------------------ header
  function renderHeader(s) {
    const run = s.run || {};
    document.title = "feast-edge: " + (s.title || "dashboard");
    text(byId("title"), s.title || "feast-edge dashboard");
    let round = 0;
    if (s.round && isNumber(s.round.round)) round = s.round.round;
    else if (isNumber(run.rounds_done)) round = run.rounds_done;
    else if (s.history.length) round = s.history[s.history.length - 1].round;
    const total = isNumber(run.rounds_total) ? run.rounds_total : "?";
    byId("round-counter").textContent = "round " + round + " / " + total;
    const status = byId("run-status");
    text(status, run.status);
    status.className = "status status-" + String(run.status || "unknown").replace(/[^a-z]/g, "");
    byId("run-message").textContent = run.message ? String(run.message) : "";
  }

  function setLive(live, how) {
    const node = byId("connection");
    node.textContent = live ? "live" : "disconnected";
    node.className = live ? "live" : "disconnected";
    node.setAttribute("title", live ? "updates arrive " + how : "no answer from the dashboard server; retrying");
  }

  // ------------------------------------------------------------------ fleet
  function renderFleet(s) {
    const rows = s.devices.map(function (d) {
      const tr = document.createElement("tr");
      tr.setAttribute("data-device", d.name);
      cell(tr, d.name, "device");
      const hardware = [d.profile, d.hardware].filter(Boolean).join(" · ");
      cell(tr, hardware);
      cell(tr, fixed(d.budget_macs, 1e6, 2), "num budget");
      cell(tr, d.precision, "precision");
      const v = d.variant || {};
      const variant = v.label || v.macs ? [v.label, isNumber(v.macs) ? fixed(v.macs, 1e6, 2) + "M MACs" : null].filter(Boolean).join(", ") : null;
      cell(tr, variant, "variant");
      const e = d.envelope || {};
      const envelope = isNumber(e.params) || isNumber(e.bytes)
        ? [isNumber(e.params) ? count(e.params) + " params" : null, isNumber(e.bytes) ? fixed(e.bytes, 1e6, 2) + " MB" : null].filter(Boolean).join(", ")
        : null;
      cell(tr, envelope, "num");
      const presence = d.online === true ? "online" : d.online === false ? "offline" : null;
      cell(tr, presence, presence || "unknown");
      const seen = cell(tr, null, "seen");
      if (isNumber(d.last_seen)) seen.setAttribute("data-seen", String(d.last_seen));
      cell(tr, isNumber(d.rounds) ? d.rounds : null, "num");
      const ver = d.version;
      const runs = ver && isNumber(ver.version)
        ? [String(ver.version), isNumber(ver.accuracy) ? "own " + fixed(ver.accuracy, 0.01, 1) + "%" : null].filter(Boolean).join(", ")
        : null;
      const vcell = cell(tr, runs, "version");
      if (ver && isNumber(ver.since)) vcell.setAttribute("title", "since " + new Date(ver.since * 1000).toLocaleString());
      const u = d.last_upload;
      const upload = u ? [u.status, u.reason ? "(" + u.reason + ")" : null, isNumber(u.round) ? "round " + u.round : null,
        isNumber(u.staleness) ? "staleness " + u.staleness : null].filter(Boolean).join(" ") : null;
      cell(tr, upload, u ? "upload upload-" + String(u.status).replace(/[^a-z]/g, "") : "upload");
      return tr;
    });
    replaceRows(document.querySelector("#fleet tbody"), rows);
    const online = s.devices.filter((d) => d.online === true).length;
    byId("fleet-count").textContent = s.devices.length ? "(" + plural(s.devices.length, "device") + ", " + online + " online)" : "";
    document.querySelector("#fleet .empty").hidden = s.devices.length > 0;
  }

  // ------------------------------------------------------------------ round in flight
  function renderRound(s) {
    const r = s.round;
    text(byId("round-title"), r ? "round " + r.round + (r.finished ? " (finished)" : "") + ": " + plural(r.members.length, "member") : idleWords(s));
    const deadline = byId("round-deadline");
    if (r && isNumber(r.deadline)) {
      deadline.textContent = "deadline " + new Date((r.deadline - clockOffset) * 1000).toLocaleTimeString();
      deadline.setAttribute("data-deadline", String(r.deadline));
    } else {
      deadline.textContent = "";
      deadline.removeAttribute("data-deadline");
    }
    renderBuffer(s.run.buffer);
    renderSecure(s.run.secure);
    const rows = (r ? r.members : []).map(function (m) {
      const tr = document.createElement("tr");
      tr.setAttribute("data-device", m.device);
      cell(tr, m.device, "device");
      cell(tr, m.state, "state state-" + String(m.state).replace(/[^a-z]/g, ""));
      const progress = cell(tr, null, "progress");
      if (isNumber(m.total) && m.total > 0) {
        const bar = document.createElement("progress");
        bar.max = m.total;
        bar.value = isNumber(m.done) ? Math.min(m.done, m.total) : 0;
        const label = document.createElement("span");
        label.textContent = " " + (isNumber(m.done) ? m.done : 0) + "/" + m.total + " chunks";
        progress.replaceChildren(bar, label);
      }
      cell(tr, m.reason, "reason");
      return tr;
    });
    replaceRows(document.querySelector("#round-members tbody"), rows);
    byId("round-members").hidden = rows.length === 0; // no round: no empty table under the words above
  }

  // No round is in flight: the run ended (a finished run directory), is between rounds, or has not begun.
  function idleWords(s) {
    const last = lastRound(s);
    const total = s.run && isNumber(s.run.rounds_total) ? " of " + s.run.rounds_total : "";
    if (ended(s)) {
      return "The run " + s.run.status + (last ? " after round " + last + total : "") + ": no round in flight.";
    }
    return last ? "No round in flight; the last was round " + last + total + "." : "No round yet.";
  }

  // Buffered asynchronous rounds (feast-server run --mode async): the updates waiting for the next release, and the
  // version each device in flight trains from; hidden for synchronous rounds.
  function renderBuffer(b) {
    const line = byId("round-buffer");
    line.hidden = !b;
    if (!b) return;
    const jobs = Object.entries(b.in_flight || {}).map(([device, version]) => device + " (version " + version + ")");
    line.textContent = "buffer " + b.held + "/" + b.size + " updates · training: " + (jobs.join(", ") || "none");
  }

  // Secure aggregation (feast-server run --secure-agg): the stage of the round in flight; hidden otherwise.
  function renderSecure(s) {
    const line = byId("round-secure");
    line.hidden = !s;
    if (!s) return;
    line.textContent = "secure aggregation, round " + s.round + ": " + s.stage + " · " + s.detail;
  }

  // ------------------------------------------------------------------ charts
  // points: one array of [x, y] per series; returns uPlot's aligned data [xs, ys1, ys2, ...] (null where a series has no y).
  function align(points) {
    const xs = Array.from(new Set(points.flat().map((p) => p[0]))).sort((a, b) => a - b);
    const index = new Map(xs.map((x, i) => [x, i]));
    const data = [xs];
    for (const series of points) {
      const ys = xs.map(() => null);
      for (const [x, y] of series) ys[index.get(x)] = y;
      data.push(ys);
    }
    return data;
  }

  function series(rows, x, y) {
    return rows.filter((r) => isNumber(r[x]) && isNumber(r[y])).map((r) => [r[x], r[y]]);
  }

  // A round axis shows whole rounds: its ticks step by ROUND_STEPS (kept in data-x-ticks), each labelled as an integer.
  function roundAxis(box, label) {
    return {
      label: label,
      incrs: ROUND_STEPS,
      values: function (u, splits) {
        box.setAttribute("data-x-ticks", splits.join(" "));
        return splits.map((v) => (Number.isInteger(v) ? String(v) : ""));
      },
    };
  }

  // empty: what an empty chart says (default: no data yet, or none in a run that ended).
  function drawChart(id, xLabel, yLabel, named, empty) {
    const box = byId(id);
    const kept = named.filter((n) => n.points.length > 0);
    const points = kept.reduce((sum, n) => sum + n.points.length, 0);
    box.setAttribute("data-points", String(points));
    const layout = JSON.stringify([xLabel, yLabel, kept.map((n) => n.label)]);
    const data = align(kept.map((n) => n.points));
    const known = charts[id];
    if (known && known.layout === layout) {
      if (JSON.stringify(data) !== known.data) {
        known.plot.setData(data);
        known.data = JSON.stringify(data);
      }
      return;
    }
    if (known) known.plot.destroy();
    delete charts[id];
    box.replaceChildren();
    box.removeAttribute("data-x-ticks");
    if (points === 0 || typeof uPlot === "undefined") {
      const note = document.createElement("p");
      note.className = "chart-empty";
      note.textContent = typeof uPlot === "undefined" ? "charts unavailable (uPlot did not load)" : empty || (ended(current) ? "no data in this run" : "no data yet");
      box.appendChild(note);
      return;
    }
    const options = {
      width: Math.max(320, box.clientWidth || 560),
      height: 260,
      scales: { x: { time: false } },
      axes: [xLabel === "round" ? roundAxis(box, xLabel) : { label: xLabel }, { label: yLabel }],
      series: [{ label: xLabel }].concat(kept.map((n, i) => ({
        label: n.label,
        stroke: COLORS[i % COLORS.length],
        width: 2,
        spanGaps: true,
        points: { show: true, size: 6 },
      }))),
    };
    charts[id] = { plot: new uPlot(options, data, box), layout: layout, data: JSON.stringify(data) };
  }

  function scaled(rows, x, y, scale) {
    return series(rows, x, y).map(([a, b]) => [a, b / scale]);
  }

  function runLabel(run) {
    return [run.name, run.method && run.method !== run.name ? run.method : null].filter(Boolean).join(" · ");
  }

  function renderLearned(s) {
    text(byId("population-accuracy"), isNumber(s.population_accuracy) ? percent(s.population_accuracy) + " %" : null);
    // Where the validation ran: on the server's data, or federated on the devices' held-out splits.
    const where = !s.runs.length && s.run && typeof s.run.validation === "string" ? s.run.validation : "";
    byId("validation-source").textContent = where ? "(" + where + ")" : "";
    if (s.runs.length) {
      drawChart("chart-accuracy-macs", "M MACs", "accuracy (%)", s.runs.map((run) => ({
        label: runLabel(run),
        points: series(run.variants || [], "macs", "test_accuracy").map(([m, a]) => [m / 1e6, 100 * a]),
      })));
      drawChart("chart-validation", "round", "val. accuracy (%)", s.runs.map((run) => ({
        label: runLabel(run),
        points: series(run.history || [], "round", "val_accuracy").map(([r, a]) => [r, 100 * a]),
      })));
    } else {
      const macs = (key) => series(s.variants, "macs", key).map(([m, a]) => [m / 1e6, 100 * a]);
      drawChart("chart-accuracy-macs", "M MACs", "accuracy (%)", [
        { label: "test accuracy", points: macs("test_accuracy") },
        { label: "validation accuracy", points: macs("val_accuracy") },
      ], s.run && s.run.server_data === false ? noServerData(s) : null);
      drawChart("chart-validation", "round", "val. accuracy (%)", [
        { label: "validation accuracy", points: series(s.history, "round", "val_accuracy").map(([r, a]) => [r, 100 * a]) },
      ]);
    }
    renderRunsTable(s.runs);
    renderPrivacy(s.history);
    renderTiming(s);
  }

  // Why a federation whose server holds no data has no accuracy-vs-MACs points, and where its figures are instead.
  function noServerData(s) {
    const why = "The server holds no data, so it tested no variant: the devices validated on their own held-out data";
    return ended(s)
      ? why + ". Their validation accuracy per round is in the chart beside; each device's own accuracy of its model is in the Models table below."
      : why + ". Points appear here once they validate the variants; until then see the validation accuracy per round beside.";
  }

  // The virtual clock of a simulation (both modes) and, for asynchronous releases, their updates' staleness;
  // hidden for a federation, which runs in real time.
  function renderTiming(s) {
    const runs = s.runs.length ? s.runs : [{ name: "", history: s.history }];
    const timed = runs.filter((run) => (run.history || []).some((h) => isNumber(h.clock)));
    byId("timing").hidden = timed.length === 0;
    byId("figure-time").hidden = timed.length === 0;
    if (!timed.length) return;
    const history = timed[0].history;
    const last = history.filter((h) => isNumber(h.clock)).pop();
    const taus = history.filter((h) => isNumber(h.staleness_max));
    text(byId("timing-clock"), Math.round(last.clock) + " s after step " + last.round);
    const mean = taus.length ? taus.reduce((sum, h) => sum + h.staleness_mean, 0) / taus.length : null;
    const most = taus.length ? Math.max.apply(null, taus.map((h) => h.staleness_max)) : null;
    byId("timing-staleness").textContent = taus.length
      ? "· staleness of released updates: mean " + mean.toFixed(2) + ", max " + most
      : "";
    drawChart("chart-time", "virtual seconds", "val. accuracy (%)", timed.map((run) => ({
      label: run.name ? runLabel(run) : "validation accuracy",
      points: series(run.history || [], "clock", "val_accuracy").map(([t, a]) => [t, 100 * a]),
    })));
  }

  // Client-level DP (feast-server run / simulate --dp-*): the last round's ε at δ; hidden for a run without DP.
  function renderPrivacy(history) {
    const last = history.filter((h) => isNumber(h.epsilon)).pop();
    byId("privacy").hidden = !last;
    text(byId("privacy-epsilon"), last ? "ε = " + last.epsilon.toPrecision(3) + " at δ = " + last.delta.toExponential(0) + " after round " + last.round : null);
  }

  function renderRunsTable(runs) {
    const table = byId("runs-table");
    table.hidden = runs.length === 0;
    const rows = runs.map(function (run) {
      const tr = document.createElement("tr");
      tr.setAttribute("data-run", String(run.name));
      const history = run.history || [];
      const vals = history.map((h) => h.val_accuracy).filter(isNumber);
      const sent = history.reduce((sum, h) => sum + (isNumber(h.bytes_down) ? h.bytes_down : 0) + (isNumber(h.bytes_up) ? h.bytes_up : 0), 0);
      cell(tr, run.name, "device");
      cell(tr, run.method);
      cell(tr, isNumber(run.seed) ? run.seed : null, "num");
      cell(tr, history.length, "num");
      cell(tr, vals.length ? percent(Math.max(...vals)) : null, "num");
      cell(tr, typeof run.validation === "string" ? run.validation.replace(/^validation: /, "") : null, "validated");
      cell(tr, percent(run.population_accuracy), "num");
      cell(tr, fixed(sent, 1e6, 2), "num");
      return tr;
    });
    replaceRows(table.querySelector("tbody"), rows);
  }

  // ------------------------------------------------------------------ traffic and compute
  function renderTraffic(s) {
    if (s.runs.length && !s.history.length) {
      drawChart("chart-traffic", "round", "MB (down + up)", s.runs.map((run) => ({
        label: runLabel(run),
        points: (run.history || []).filter((h) => isNumber(h.round) && (isNumber(h.bytes_down) || isNumber(h.bytes_up)))
          .map((h) => [h.round, ((h.bytes_down || 0) + (h.bytes_up || 0)) / 1e6]),
      })));
      drawChart("chart-compute", "round", "G MACs", s.runs.map((run) => ({
        label: runLabel(run), points: scaled(run.history || [], "round", "train_macs", 1e9),
      })));
    } else {
      drawChart("chart-traffic", "round", "MB", [
        { label: "down (routed)", points: scaled(s.history, "round", "bytes_down", 1e6) },
        { label: "up (returned)", points: scaled(s.history, "round", "bytes_up", 1e6) },
        { label: "full-supernet broadcast", points: scaled(s.history, "round", "broadcast_bytes", 1e6) },
      ]);
      drawChart("chart-compute", "round", "G MACs", [
        { label: "training compute", points: scaled(s.history, "round", "train_macs", 1e9) },
      ]);
    }
    const totals = new Map();
    for (const h of s.history) {
      for (const [name, bytes] of Object.entries(h.devices || {})) {
        const t = totals.get(name) || { down: 0, up: 0, rounds: 0 };
        t.down += isNumber(bytes && bytes.down) ? bytes.down : 0;
        t.up += isNumber(bytes && bytes.up) ? bytes.up : 0;
        t.rounds += 1;
        totals.set(name, t);
      }
    }
    const rows = Array.from(totals.keys()).sort().map(function (name) {
      const t = totals.get(name);
      const tr = document.createElement("tr");
      tr.setAttribute("data-device", name);
      cell(tr, name, "device");
      cell(tr, fixed(t.down, 1e6, 3), "num");
      cell(tr, fixed(t.up, 1e6, 3), "num");
      cell(tr, t.rounds, "num");
      return tr;
    });
    replaceRows(document.querySelector("#traffic-devices tbody"), rows);
    byId("traffic-devices").hidden = rows.length === 0;
  }

  // ------------------------------------------------------------------ models
  function renderModels(s) {
    const rows = s.models.map(function (m) {
      const tr = document.createElement("tr");
      tr.setAttribute("data-device", m.device);
      cell(tr, m.device, "device");
      cell(tr, m.variant, "variant");
      cell(tr, fixed(m.macs, 1e6, 2), "num");
      // Which rule chose it (the largest affordable, or a smaller one better on validation) and the classes its own
      // weights were trained on (a variant only a few devices can run may never have seen some).
      cell(tr, m.chosen_by, "chosen-by");
      cell(tr, m.classes_trained, "coverage", typeof m.classes_validated === "string" ? "validated on " + m.classes_validated : null);
      cell(tr, m.precision, "precision");
      // A device-calibrated model: the held-out accuracy its device reported; else the validation on the server's data.
      cell(tr, percent(isNumber(m.accuracy) ? m.accuracy : m.validation_accuracy), "num accuracy");
      cell(tr, m.accuracy_note, "measured calibration-" + String(m.calibration || "server").replace(/[^a-z]/g, ""));
      // Its personal model: the device's own held-out accuracy and how it was made (checked on the server), and the
      // classes it was tuned to where those are fewer than all ("tuned to 6 of 10 classes: ...; serve the global ...").
      cell(tr, percent(m.personal_accuracy), "num personal");
      const tuned = typeof m.personal_tuned === "string" && m.personal_tuned ? m.personal_tuned : "";
      const note = typeof m.personal_note === "string" && tuned ? m.personal_note + "; " + tuned : m.personal_note;
      cell(tr, note, "personal-note", typeof m.personal_reason === "string" ? m.personal_reason : null);
      const sha = typeof m.sha256 === "string" ? m.sha256 : "";
      cell(tr, sha ? sha.slice(0, 12) + "…" : null, "sha", sha);
      const link = cell(tr, m.calibration === "device" || m.calibration === "federated" ? "on the device" : null, "download");
      if (typeof m.url === "string" && m.url.startsWith("models/")) {
        const a = document.createElement("a");
        a.setAttribute("href", m.url);
        a.setAttribute("download", "");
        a.textContent = "ONNX" + (isNumber(m.size) ? " (" + fixed(m.size, 1e6, 2) + " MB)" : "");
        link.replaceChildren(a);
      }
      return tr;
    });
    replaceRows(document.querySelector("#models tbody"), rows);
    document.querySelector("#models .empty").hidden = s.models.length > 0;
    // The round whose weights the models are, and why the serving rule chose it (not always the last round).
    const served = byId("served-round");
    const words = typeof s.served === "string" && s.served ? "served: " + s.served : "";
    served.textContent = shortened(words, SERVED_CHARS);
    if (served.textContent !== words) served.setAttribute("title", words);
    else served.removeAttribute("title");
    served.hidden = !words;
    renderOwnAccuracy(s.own_accuracy);
  }

  // Over the models the devices calibrated: the means of their own accuracy, served and personal, and the worst of
  // each column with its own device (the lowest served accuracy and the lowest personal one are often two devices).
  function renderOwnAccuracy(own) {
    const foot = byId("own-accuracy");
    const rows = [];
    if (own && isNumber(own.devices)) {
      const counted = own.counted + " of " + plural(own.devices, "device");
      rows.push(["mean", counted, percent(own.served), percent(own.personal), "own held-out accuracy, mean over the devices"]);
      if (own.counted > 0) {
        const worst = (device, value) => (typeof device === "string" && isNumber(value) ? device + " " + percent(value) : null);
        rows.push(["worst", null, worst(own.worst_served_device, own.worst_served),
          worst(own.worst_personal_device, own.worst_personal), "the lowest of each column, with its device"]);
      }
    }
    replaceRows(
      foot,
      rows.map(function ([kind, who, served, personal, words]) {
        const tr = document.createElement("tr");
        tr.className = "own-" + kind;
        cell(tr, kind, "device");
        if (who === null) tr.append(document.createElement("td"));
        else cell(tr, who, "variant");
        tr.append(document.createElement("td"), document.createElement("td"), document.createElement("td"));
        tr.append(document.createElement("td"));
        cell(tr, served, "num accuracy");
        cell(tr, words, "measured");
        cell(tr, personal, "num personal");
        tr.append(document.createElement("td"), document.createElement("td"), document.createElement("td"));
        return tr;
      })
    );
    foot.hidden = rows.length === 0;
  }

  // ------------------------------------------------------------------ clock
  function tick() {
    const now = serverNow();
    for (const node of document.querySelectorAll("[data-seen]")) {
      node.textContent = ago(now - Number(node.getAttribute("data-seen")));
    }
    const deadline = byId("round-deadline").getAttribute("data-deadline");
    const left = byId("round-left");
    if (deadline === null || !current || !current.round) {
      left.textContent = "";
    } else if (current.round.finished) {
      left.textContent = "";
    } else {
      const seconds = Number(deadline) - now;
      left.textContent = seconds > 0 ? Math.ceil(seconds) + " s left" : "deadline passed";
    }
  }

  // ------------------------------------------------------------------ updates
  function render(s) {
    current = s;
    clockOffset = isNumber(s.now) ? s.now - Date.now() / 1000 : 0;
    renderHeader(s);
    renderFleet(s);
    renderRound(s);
    renderLearned(s);
    renderTraffic(s);
    renderModels(s);
    tick();
  }

  async function pollOnce() {
    try {
      const response = await fetch("api/state", { cache: "no-store", credentials: "same-origin" });
      if (!response.ok) throw new Error("HTTP " + response.status);
      render(await response.json());
      setLive(true, "by polling every " + POLL_MS / 1000 + " s");
    } catch (error) {
      setLive(false);
    }
  }

  function startPolling() {
    if (polling !== null) return;
    polling = setInterval(pollOnce, POLL_MS);
    pollOnce();
  }

  function connect() {
    if (typeof EventSource === "undefined") {
      startPolling();
      return;
    }
    const source = new EventSource("api/events");
    source.onmessage = function (event) {
      setLive(true, "as server-sent events");
      render(JSON.parse(event.data));
    };
    source.onerror = function () {
      source.close();
      setLive(false);
      startPolling();
    };
  }

  window.addEventListener("resize", function () {
    for (const id of Object.keys(charts)) {
      charts[id].plot.setSize({ width: Math.max(320, byId(id).clientWidth), height: 260 });
    }
  });
  setInterval(tick, 1000);
  connect();
})();
