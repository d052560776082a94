// The job page: header and controls, live event stream, training curves, schedule editor, trajectories.
"use strict";
(() => {
  if (!Taper.initChrome()) return;
  const { el, api } = Taper;
  const jobId = decodeURIComponent(location.pathname.split("/").filter(Boolean).pop());
  const base = `/v1/jobs/${encodeURIComponent(jobId)}`;
  const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
  let job = null;
  let rows = [];
  let cursor = null;
  let pulling = null;

  const schedule = ScheduleEditor.create({ jobId, onPatched: () => refreshJob(), totalSteps: () => job && job.total_steps });
  const trajectories = TrajectoryViewer.create({ jobId });

  function renderJob() {
    document.title = `Taper · ${job.name}`;
    document.getElementById("job-name").textContent = job.name;
    document.getElementById("job-id").textContent = job.id;
    const badge = document.getElementById("job-state");
    badge.className = `badge state-${job.state}`;
    badge.dataset.state = job.state;
    badge.textContent = job.state + (job.control !== "run" && !TERMINAL.has(job.state) ? ` (${job.control} requested)` : "");
    document.getElementById("job-progress-bar").style.width = `${(100 * job.progress).toFixed(1)}%`;
    document.getElementById("job-progress-text").textContent = `step ${job.step} / ${job.total_steps}`;
    document.getElementById("job-attempts").textContent = job.attempts > 1 ? `attempt ${job.attempts}` : "";
    Taper.showError("job-error", job.error ? { message: job.error } : null);
    const can = {
      pause: ["starting", "running"].includes(job.state) && job.control === "run",
      resume: job.state === "paused" || job.control === "pause",
      cancel: !TERMINAL.has(job.state) && job.control !== "cancel",
    };
    for (const b of document.querySelectorAll("[data-action]")) b.disabled = !can[b.dataset.action];
  }

  async function refreshJob() {
    try {
      job = await api(base);
      renderJob();
    } catch (e) {
      Taper.showError("error", e);
    }
  }

  // Pull every metrics row after the cursor (pages of 1000), then redraw.
  function pullMetrics() {
    if (pulling) return pulling;
    pulling = (async () => {
      try {
        let fresh = 0;
        for (;;) {
          const q = new URLSearchParams({ limit: "1000" });
          if (cursor) q.set("after", cursor);
          const page = await api(`${base}/metrics?${q}`);
          if (page.items.length) { rows = rows.concat(page.items); cursor = page.items[page.items.length - 1].id; fresh += page.items.length; }
          if (!page.next) break;
        }
        if (fresh || !document.getElementById("charts").children.length) {
          const out = Charts.update(document.getElementById("charts"), rows);
          document.getElementById("charts-empty").hidden = out.keys.length > 0;
          document.getElementById("metrics-count").textContent = rows.length ? `${rows.length} steps` : "";
          schedule.setObserved(rows, job ? job.step : undefined);
        }
      } catch (e) {
        Taper.showError("error", e);
      } finally {
        pulling = null;
      }
    })();
    return pulling;
  }

  function describe(ev) {
    const d = Object.assign({}, ev.data);
    const ts = d.ts;
    delete d.ts;
    if (ev.kind === "state") return [ts, `${d.from} → ${d.to}${d.reason ? ` (${d.reason})` : ""}`];
    if (ev.kind === "schedule_patched") return [ts, `schedule v${d.version} from step ${d.effective_from}: ${JSON.stringify(d.patch)}`];
    return [ts, Object.keys(d).length ? JSON.stringify(d) : ""];
  }

  function onEvent(ev) {
    const [ts, text] = describe(ev);
    const list = document.getElementById("events");
    list.prepend(el("li", { "data-kind": ev.kind, "data-id": ev.id },
      el("span", { class: "muted" }, ts ? new Date(ts * 1000).toLocaleTimeString() : ""), " ",
      el("strong", {}, ev.kind), " ", text));
    while (list.children.length > 500) list.lastChild.remove();
    if (ev.kind === "state" && ev.data.to) {
      if (job) { job.state = ev.data.to; renderJob(); }
      refreshJob();
    }
    if (ev.kind === "schedule_patched") { schedule.load().catch((e) => Taper.showError("schedule-error", e)); refreshJob(); }
    if (ev.kind === "checkpoint") loadCheckpoints();
    scheduleMetricsPull();
  }

  let pullTimer = null;
  function scheduleMetricsPull() {
    if (pullTimer) return;
    pullTimer = setTimeout(() => { pullTimer = null; pullMetrics(); }, 200);
  }

  async function loadCheckpoints() {
    try {
      const cps = await api(`${base}/checkpoints`);
      document.querySelector("#checkpoints tbody").replaceChildren(...cps.slice().reverse().map((c) =>
        el("tr", {}, el("td", {}, c.step), el("td", { class: "mono small" }, c.checkpoint), el("td", { class: "small" }, Taper.fmtTime(c.ts)))));
    } catch (e) { /* the page's other parts report errors */ }
  }

  for (const b of document.querySelectorAll("[data-action]")) {
    b.addEventListener("click", async () => {
      if (b.dataset.action === "cancel" && !confirm("Cancel this job?")) return;
      try {
        job = await api(`${base}/${b.dataset.action}`, { method: "POST" });
        renderJob();
      } catch (e) { Taper.showError("error", e); }
    });
  }

  (async () => {
    await refreshJob();
    if (!job) return;
    const streamStatus = document.getElementById("stream-status");
    streamStatus.dataset.status = "connecting";
    Taper.streamEvents(`${base}/events`, {
      onEvent,
      onStatus: (s) => { streamStatus.textContent = s === "live" ? "● live" : s; streamStatus.dataset.status = s; },
      shouldReconnect: () => !job || !TERMINAL.has(job.state),
    });
    await Promise.all([schedule.load().catch((e) => Taper.showError("schedule-error", e)), pullMetrics(), loadCheckpoints(),
                       trajectories.load()]);
    // Metrics have no events of their own: poll them (cheap: only rows after the cursor) while the job is active.
    setInterval(async () => {
      if (document.hidden || !job || TERMINAL.has(job.state)) return;
      await refreshJob();
      await pullMetrics();
      trajectories.refreshIfEmpty();
    }, 1000);
  })();
})();
