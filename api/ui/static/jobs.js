"use strict";
(() => {
  if (!Taper.initChrome()) return;
  const { el, api } = Taper;
  const body = document.querySelector("#jobs-table tbody");
  const filter = document.getElementById("state-filter");

  function progress(job) {
    return el("div", { class: "progress small" },
      el("div", { style: `width:${(100 * job.progress).toFixed(1)}%` }));
  }

  async function refresh() {
    const q = new URLSearchParams({ limit: "200" });
    if (filter.value) q.set("state", filter.value);
    try {
      const page = await api("/v1/jobs?" + q);
      Taper.showError("error", null);
      body.replaceChildren(...page.items.map((job) => el("tr", { "data-job": job.id },
        el("td", {}, el("a", { href: `/ui/jobs/${encodeURIComponent(job.id)}` }, job.name)),
        el("td", { class: "mono small" }, job.id),
        el("td", {}, Taper.stateBadge(job.state), job.control !== "run" ? el("span", { class: "muted small" }, ` (${job.control} requested)`) : null),
        el("td", {}, progress(job), el("span", { class: "small" }, ` ${job.step}/${job.total_steps}`)),
        el("td", {}, job.spec.environment.name),
        el("td", { class: "small" }, Taper.fmtTime(job.created_at)),
        el("td", { class: "small" }, `${job.spec.reward_schedule.kind} v${job.schedule_version}`),
      )));
      document.getElementById("jobs-total").textContent = `${page.total} job(s)`;
      document.getElementById("jobs-empty").hidden = page.total > 0;
    } catch (e) {
      Taper.showError("error", e);
    }
  }

  filter.addEventListener("change", refresh);
  refresh();
  setInterval(() => { if (!document.hidden) refresh(); }, 3000);
})();
