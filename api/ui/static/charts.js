// Training curves from the metrics rows of GET /v1/jobs/{id}/metrics. Every numeric metric key is plotted;
// the key's prefix picks its chart, so keys the job runner adds later still show up (under "Other").
"use strict";

const Charts = (() => {
  // First match wins. Keys follow rl_service.training.runner: reward/<credit stat>, reward/process/<component>/raw|weighted,
  // schedule/*, success_rate, eval/*, loss*, kl, entropy, time/<phase>, tokens_per_s, ...
  const GROUPS = [
    { id: "success", title: "Success rate (train and eval)", match: (k) => /(^|\/)success_rate$/.test(k) },
    { id: "rewards-weighted", title: "Process rewards, weighted by w(t)",
      match: (k) => k.startsWith("reward/") && /(\/weighted|_weighted_mean)$/.test(k) },
    { id: "schedule", title: "Schedule weight w(t), density (dashed: version change)",
      match: (k) => (k.startsWith("schedule/") && k !== "schedule/version") || k === "reward/process_weight" },
    { id: "advantages", title: "Advantages", match: (k) => k.includes("advantage") },
    { id: "batch", title: "Batch (trajectories, nodes, staleness)",
      match: (k) => /^reward\/(num_|nodes_|zero_variance)/.test(k) || /^(trajectories|staleness)\//.test(k) },
    { id: "rewards-raw", title: "Reward components (raw)", match: (k) => k.startsWith("reward/") },
    { id: "optim", title: "Loss, KL, entropy", match: (k) => /^(loss|kl|entropy)(\/|$)/.test(k) },
    { id: "optimizer", title: "Optimizer (grad norm, clipping, IS ratio, mismatch)",
      match: (k) => /^(grad_norm|learning_rate|clip_ratio|is_ratio|logprob_mismatch)/.test(k) },
    { id: "time", title: "Time split per step (s)", stacked: true, match: (k) => k.startsWith("time/") },
    { id: "throughput", title: "Throughput (tokens/s)", match: (k) => k.startsWith("throughput/") || k.endsWith("per_s") },
    { id: "eval", title: "Evaluation", match: (k) => k.startsWith("eval/") },
    { id: "other", title: "Other metrics", match: () => true },
  ];
  const TOTAL_KEY = /\/(step|total)$/;  // a total among stacked parts is drawn as a line, not a bar
  const SKIP = new Set(["step", "schedule/version"]);
  const PLOT_CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["select2d", "lasso2d"] };

  const groupOf = (key) => GROUPS.find((g) => g.match(key));

  // rows: [{step, metrics: {...}}] oldest first -> {key: {x: [...], y: [...]}}
  function series(rows) {
    const out = {};
    for (const row of rows) {
      for (const [k, v] of Object.entries(row.metrics || {})) {
        if (SKIP.has(k) || !(typeof v === "number" || v === null)) continue;
        const s = out[k] || (out[k] = { x: [], y: [] });
        s.x.push(row.step);
        s.y.push(v);
      }
    }
    return out;
  }

  // Steps where the schedule version changed, from the `schedule/version` metric.
  function versionChanges(rows) {
    const changes = [];
    let prev = null;
    for (const row of rows) {
      const v = row.metrics && row.metrics["schedule/version"];
      if (typeof v !== "number") continue;
      if (prev !== null && v !== prev) changes.push({ step: row.step, version: v });
      prev = v;
    }
    return changes;
  }

  function versionShapes(changes) {
    return {
      shapes: changes.map((c) => ({ type: "line", xref: "x", yref: "paper", x0: c.step, x1: c.step, y0: 0, y1: 1,
                                   line: { dash: "dash", width: 1, color: "#b45309" } })),
      annotations: changes.map((c) => ({ xref: "x", yref: "paper", x: c.step, y: 1, yanchor: "bottom",
                                        showarrow: false, text: `v${c.version}`, font: { size: 10, color: "#b45309" } })),
    };
  }

  function layout(title, extra) {
    return Object.assign({
      title: { text: title, font: { size: 13 } }, height: 260, margin: { l: 50, r: 10, t: 30, b: 30 },
      xaxis: { automargin: true }, legend: { font: { size: 10 }, orientation: "h", yanchor: "top", y: -0.18 },
      hovermode: "x unified", uirevision: title,
    }, extra || {});
  }

  function shortName(key, group) {
    if (group.id.startsWith("rewards")) return key.replace(/^reward\/(process\/)?/, "").replace(/\/(raw|weighted)$/, "");
    if (group.id === "time") return key.slice("time/".length);
    return key;
  }

  function update(container, rows) {
    const data = series(rows);
    const keys = Object.keys(data).sort();
    const byGroup = new Map();
    for (const k of keys) {
      const g = groupOf(k);
      if (!byGroup.has(g.id)) byGroup.set(g.id, []);
      byGroup.get(g.id).push(k);
    }
    const changes = versionChanges(rows);
    for (const group of GROUPS) {
      const groupKeys = byGroup.get(group.id);
      if (!groupKeys) continue;
      let div = document.getElementById("chart-" + group.id);
      if (!div) {
        div = Taper.el("div", { id: "chart-" + group.id, class: "chart", "data-group": group.id });
        // keep the GROUPS order however late a group first appears
        const after = GROUPS.slice(GROUPS.indexOf(group) + 1).map((g) => document.getElementById("chart-" + g.id)).find(Boolean);
        container.insertBefore(div, after || null);
      }
      const traces = groupKeys.map((k) => group.stacked && !TOTAL_KEY.test(k)
        ? { type: "bar", name: shortName(k, group), x: data[k].x, y: data[k].y, meta: k }
        : { type: "scatter", mode: data[k].x.length > 30 ? "lines" : "lines+markers", connectgaps: true,
            name: shortName(k, group), x: data[k].x, y: data[k].y, meta: k });
      // room for the legend below the plot (about three names per row)
      const extra = { height: 240 + 18 * Math.ceil(traces.length / 3), ...(group.stacked ? { barmode: "stack" } : {}) };
      if (group.id === "schedule" || group.id.startsWith("rewards")) Object.assign(extra, versionShapes(changes));
      div.dataset.keys = groupKeys.join(",");
      div.dataset.points = String(Math.max(...groupKeys.map((k) => data[k].x.length)));
      Plotly.react(div, traces, layout(group.title, extra), PLOT_CONFIG);
    }
    return { keys, changes };
  }

  return { GROUPS, groupOf, series, versionChanges, update, layout, PLOT_CONFIG };
})();
