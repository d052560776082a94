// The schedule editor: the curve in force (every version), a live preview of an edit (computed by the server
// exactly as the PATCH would store it), and the PATCH itself.
"use strict";

const ScheduleEditor = (() => {
  const KIND_ONLY = { half_life: "exponential", milestones: "step", points: "piecewise" };
  const NULLABLE = new Set(["density_end"]);

  // The measured recommendation (README, "Which decay should I use?"): the weight falls linearly from 1 to 0 over the
  // whole run; the kind-only fields are cleared so the preview shows exactly that curve.
  function recommended(totalSteps) {
    return { kind: "linear", w_start: 1, w_end: 0, warmup: 0, horizon: totalSteps,
             half_life: null, milestones: null, points: null };
  }

  function create({ jobId, onPatched, totalSteps }) {
    const form = document.getElementById("schedule-form");
    const chart = document.getElementById("schedule-chart");
    const applyButton = document.getElementById("schedule-apply");
    const base = `/v1/jobs/${encodeURIComponent(jobId)}`;
    let current = null;       // ScheduleOut of the API
    let curves = null;        // preview of the current history
    let proposed = null;      // preview of the pending patch
    let pendingPatch = null;
    let observed = { x: [], y: [] };
    let jobStep = 0;
    let timer = null;
    let seq = 0;

    const inputs = () => Array.from(form.querySelectorAll("[name]"));

    function showKindFields() {
      const kind = form.elements.kind.value;
      for (const label of form.querySelectorAll("[data-kind]")) label.hidden = label.dataset.kind !== kind;
    }

    function fill(schedule) {
      for (const input of inputs()) input.value = Taper.formatInput(schedule[input.name], input.dataset.type);
      showKindFields();
    }

    // The fields that differ from the schedule in force (what PATCH merges into it).
    function patchFromForm() {
      const cur = current.schedule;
      const kind = form.elements.kind.value;
      const patch = {};
      for (const input of inputs()) {
        const name = input.name;
        if (KIND_ONLY[name] && KIND_ONLY[name] !== kind) continue;
        let value = Taper.readInput(input, name);
        if (value === undefined) {
          if (!NULLABLE.has(name) && !KIND_ONLY[name]) continue;  // left empty: keep the current value
          value = null;
        }
        if (KIND_ONLY[name] && value === null && kind !== cur.kind) continue;  // let the API say it is required
        if (JSON.stringify(value) !== JSON.stringify(cur[name] === undefined ? null : cur[name])) patch[name] = value;
      }
      return patch;
    }

    function markField(field) {
      for (const input of inputs()) input.classList.toggle("invalid", !!field && field.split(".").pop() === input.name);
    }

    function draw() {
      if (!curves) return;
      const traces = [
        { type: "scatter", mode: "lines", name: "w(t) in force", x: curves.steps, y: curves.current.weight,
          line: { color: "#2563eb", width: 2 }, meta: "current" },
        { type: "scatter", mode: "lines", name: "node density", x: curves.steps, y: curves.current.density,
          line: { color: "#94a3b8", width: 1, dash: "dot" }, meta: "density" },
      ];
      if (proposed) {
        traces.push({ type: "scatter", mode: "lines", name: `proposed v${proposed.version}`, x: curves.steps,
                      y: proposed.weight, line: { color: "#dc2626", width: 2, dash: "dash" }, meta: "proposed" });
      }
      if (observed.x.length) {
        traces.push({ type: "scatter", mode: "markers", name: "w(t) used (metrics)", x: observed.x, y: observed.y,
                      marker: { size: 5, color: "#16a34a" }, meta: "observed" });
      }
      const shapes = [{ type: "line", xref: "x", yref: "paper", x0: jobStep, x1: jobStep, y0: 0, y1: 1,
                        line: { color: "#111827", width: 1, dash: "dot" } }];
      const annotations = [{ xref: "x", yref: "paper", x: jobStep, y: 1, yanchor: "bottom", showarrow: false,
                             text: "now", font: { size: 10 } }];
      for (const v of curves.versions.filter((v) => v.version > 1)) {
        shapes.push({ type: "line", xref: "x", yref: "paper", x0: v.effective_from, x1: v.effective_from, y0: 0, y1: 1,
                      line: { color: "#b45309", width: 1, dash: "dash" } });
        annotations.push({ xref: "x", yref: "paper", x: v.effective_from, y: 0.92, showarrow: false,
                           text: `v${v.version}`, font: { size: 10, color: "#b45309" } });
      }
      chart.dataset.version = String(curves.versions[curves.versions.length - 1].version);  // what is drawn
      chart.dataset.proposed = proposed ? "1" : "";
      Plotly.react(chart, traces, Charts.layout("w(t) and node density", { shapes, annotations, height: 300,
        yaxis: { rangemode: "tozero" } }), Charts.PLOT_CONFIG);
    }

    function renderVersions() {
      document.getElementById("schedule-version").textContent =
        `version ${current.version}, ${current.schedule.kind}, from step ${current.effective_from}`;
      document.querySelector("#schedule-versions tbody").replaceChildren(...current.history.slice().reverse().map((v) =>
        Taper.el("tr", { "data-version": v.version },
          Taper.el("td", {}, `v${v.version}`), Taper.el("td", {}, v.effective_from),
          Taper.el("td", {}, v.applied_at === null ? "submitted" : v.applied_at),
          Taper.el("td", { class: "mono" }, v.version === 1 ? JSON.stringify(v.schedule) : JSON.stringify(v.patch)))));
    }

    async function preview() {
      const mine = ++seq;
      Taper.showError("schedule-error", null);
      markField(null);
      let patch;
      try { patch = patchFromForm(); } catch (e) {
        proposed = null; pendingPatch = null; applyButton.disabled = true;
        Taper.showError("schedule-error", e); markField(e.field); draw(); return;
      }
      const empty = Object.keys(patch).length === 0;
      document.getElementById("schedule-patch").textContent = empty ? "" : "PATCH " + JSON.stringify(patch);
      try {
        const out = await Taper.api(`/ui/api/jobs/${encodeURIComponent(jobId)}/schedule-preview`, { method: "POST", body: patch });
        if (mine !== seq) return;  // a newer edit is already on its way
        curves = out;
        jobStep = out.job_step;
        proposed = out.proposed;
        pendingPatch = empty ? null : patch;
        applyButton.disabled = empty;
      } catch (e) {
        if (mine !== seq) return;
        proposed = null; pendingPatch = null; applyButton.disabled = true;
        Taper.showError("schedule-error", e); markField(e.field);
      }
      draw();
    }

    async function load() {
      current = await Taper.api(`${base}/reward-schedule`);
      fill(current.schedule);
      renderVersions();
      await preview();
    }

    form.addEventListener("input", () => {
      showKindFields();
      document.getElementById("schedule-status").textContent = "";
      clearTimeout(timer);
      timer = setTimeout(preview, 250);
    });
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      clearTimeout(timer);
      await preview();
      if (!pendingPatch) return;
      applyButton.disabled = true;
      try {
        const out = await Taper.api(`${base}/reward-schedule`, { method: "PATCH", body: pendingPatch });
        document.getElementById("schedule-status").textContent =
          `Applied: version ${out.version}, effective from step ${out.effective_from}.`;
        await load();
        if (onPatched) onPatched(out);
      } catch (e) {
        Taper.showError("schedule-error", e); markField(e.field);
        applyButton.disabled = false;
      }
    });
    document.getElementById("schedule-reset").addEventListener("click", () => { fill(current.schedule); preview(); });
    document.getElementById("schedule-recommended").addEventListener("click", () => {
      fill({ ...current.schedule, ...recommended(totalSteps() || current.schedule.horizon) });
      preview();
    });

    return {
      load,
      // called by the job page with the metrics rows and the job's step
      setObserved(rows, step) {
        observed = { x: [], y: [] };
        for (const r of rows) {
          const w = r.metrics && r.metrics["schedule/weight"];
          // a metrics row of step s reports training step s - 1 (the runner counts steps done)
          if (typeof w === "number") { observed.x.push(r.step - 1); observed.y.push(w); }
        }
        if (typeof step === "number") jobStep = step;
        draw();
      },
      current: () => current,
    };
  }

  return { create, recommended };
})();
