// The trajectory list (filter by status, reward, step; paged) and viewer: turns, tool calls and results,
// per-step process rewards, and every completion token with its loss mask and logprob on hover.
"use strict";

const TrajectoryViewer = (() => {
  const PAGE = 20;

  function create({ jobId }) {
    const { el } = Taper;
    const form = document.getElementById("traj-filter");
    const body = document.querySelector("#traj-table tbody");
    const viewer = document.getElementById("traj-viewer");
    const readout = document.getElementById("token-readout");
    let offset = 0;
    let items = [];
    let selected = null;

    function query() {
      const q = new URLSearchParams({ offset: String(offset), limit: String(PAGE) });
      for (const name of ["status", "min_reward", "max_reward", "step"]) {
        const v = form.elements[name].value.trim();
        if (v !== "") q.set(name, v);
      }
      return q;
    }

    const toolCount = (t) => t.steps.reduce((n, s) => n + s.tool_calls.length, 0);

    async function load() {
      Taper.showError("traj-error", null);
      try {
        const page = await Taper.api(`/v1/jobs/${encodeURIComponent(jobId)}/trajectories?${query()}`);
        items = page.items;
      } catch (e) {
        Taper.showError("traj-error", e);
        return;
      }
      document.getElementById("traj-page").textContent =
        items.length ? `${offset + 1}–${offset + items.length}` : offset ? "no more" : "none yet";
      document.getElementById("traj-prev").disabled = offset === 0;
      document.getElementById("traj-next").disabled = items.length < PAGE;
      body.replaceChildren(...items.map((t, i) => el("tr", {
        class: "clickable" + (selected === t.id ? " selected" : ""), "data-traj": t.id, "data-status": t.status,
        onclick: () => show(items[i]),
      },
        el("td", {}, t.train_step ?? "—"),
        el("td", {}, el("span", { class: `badge traj-${t.status}` }, t.status)),
        el("td", {}, Taper.fmtNum(t.outcome_reward, 3)),
        el("td", {}, t.steps.length),
        el("td", {}, toolCount(t)),
        el("td", { class: "small" }, t.task_id))));
    }

    const pieces = new Map();  // token id -> text, decoded by the server with the job's tokenizer

    const visible = (text) => text.replace(/\n/g, "↵").replace(/\t/g, "→");

    function tokenStrip(step, stepIndex) {
      const spans = [];
      step.action_ids.forEach((id, j) => {
        const lp = step.action_logprobs[j];
        const p = typeof lp === "number" ? Math.exp(lp) : null;
        spans.push(el("span", { class: "tok act", style: p === null ? null : `--p:${p.toFixed(3)}`,
          dataset: { id: String(id), turn: String(stepIndex), pos: String(j), mask: "1", logprob: String(lp) } },
          pieces.has(id) ? visible(pieces.get(id)) : ""));
      });
      step.observation_ids.forEach((id, j) => {
        spans.push(el("span", { class: "tok obs", dataset: { id: String(id), turn: String(stepIndex), pos: String(j), mask: "0" } },
          pieces.has(id) ? visible(pieces.get(id)) : ""));
      });
      return el("div", { class: "tokens", title: "completion tokens: hover for mask and logprob" }, spans);
    }

    function tokenInfo(tok) {
      const d = tok.dataset;
      const id = Number(d.id);
      const text = pieces.has(id) ? ` ${JSON.stringify(pieces.get(id))}` : "";
      if (d.mask === "1") {
        const lp = Number(d.logprob);
        return `turn ${d.turn} · action token ${d.pos}${text} · id ${id} · mask 1 (trained) · logprob ${Taper.fmtNum(lp, 4)} · p ${Math.exp(lp).toFixed(3)}`;
      }
      return `turn ${d.turn} · observation token ${d.pos}${text} · id ${id} · mask 0 (inserted, not trained)`;
    }

    async function decode(t) {
      const missing = [...new Set(t.steps.flatMap((s) => s.action_ids.concat(s.observation_ids)))].filter((i) => !pieces.has(i));
      if (!missing.length) return;
      try {
        const out = await Taper.api(`/ui/api/jobs/${encodeURIComponent(jobId)}/tokens`, { method: "POST", body: { ids: missing } });
        for (const [k, v] of Object.entries(out.pieces)) pieces.set(Number(k), v);
      } catch (e) {
        return;  // the strip still works without text
      }
      if (selected !== t.id) return;
      for (const tok of viewer.querySelectorAll(".tok")) {
        const id = Number(tok.dataset.id);
        if (pieces.has(id)) tok.textContent = visible(pieces.get(id));
      }
      viewer.dataset.decoded = t.id;
    }

    function toolCallBox(call) {
      const args = call.arguments ? JSON.stringify(call.arguments) : call.raw;
      return el("div", { class: "tool-call" + (call.error ? " failed" : ""), "data-tool": call.name || "" },
        el("div", { class: "tool-head" },
          el("span", { class: "tool-name" }, call.name || "(unparsed)"),
          el("code", { class: "tool-args" }, args),
          el("span", { class: "muted small" }, ` ${Taper.fmtNum(call.latency_s, 3)} s`)),
        call.result !== null && call.result !== undefined ? el("pre", { class: "tool-result" }, call.result) : null,
        call.error ? el("pre", { class: "tool-error" }, `${call.error_kind || "error"}: ${call.error}`) : null);
    }

    function rewardChips(rewards) {
      const entries = Object.entries(rewards || {});
      if (!entries.length) return null;
      return el("div", { class: "chips" }, entries.map(([k, v]) =>
        el("span", { class: "chip", "data-component": k, style: `--r:${Math.max(0, Math.min(1, v)).toFixed(3)}` },
          `${k} ${Taper.fmtNum(v, 3)}`)));
    }

    function show(t) {
      selected = t.id;
      for (const row of body.querySelectorAll("tr")) row.classList.toggle("selected", row.dataset.traj === t.id);
      const turns = t.steps.map((s, i) => el("div", { class: "turn", "data-turn": i },
        el("div", { class: "turn-head" },
          el("strong", {}, `Turn ${i + 1}`),
          el("span", { class: "muted small" },
            ` policy v${s.weight_version} · ${s.action_ids.length} sampled + ${s.observation_ids.length} inserted tokens` +
            (s.finish_reason ? ` · ${s.finish_reason}` : "") + (s.is_final ? " · final answer" : "")),
          rewardChips(s.process_rewards)),
        el("pre", { class: "action" }, s.action_text),
        s.tool_calls.map(toolCallBox),
        s.observation_text ? el("pre", { class: "observation" }, s.observation_text) : null,
        tokenStrip(s, i + 1)));
      viewer.replaceChildren(...[
        el("div", { class: "traj-head" },
          el("span", { class: `badge traj-${t.status}` }, t.status),
          el("strong", {}, ` reward ${Taper.fmtNum(t.outcome_reward, 3)}`),
          el("span", { class: "muted small" }, ` · step ${t.train_step ?? "—"} · ${t.env} · task ${t.task_id} · group ${t.group_id}`),
          el("code", { class: "small muted" }, ` ${t.id}`)),
        t.error ? el("pre", { class: "tool-error" }, t.error) : null,
        el("details", {}, el("summary", {}, "Task"), el("pre", { class: "mono small" }, JSON.stringify(t.task, null, 2))),
        el("details", {}, el("summary", {}, `Prompt (${t.prompt_ids.length} tokens)`), el("pre", { class: "prompt" }, t.prompt_text)),
        ...turns].filter(Boolean));
      decode(t);
    }

    viewer.addEventListener("mouseover", (ev) => {
      const tok = ev.target.closest(".tok");
      if (!tok) return;
      readout.hidden = false;
      readout.textContent = tokenInfo(tok);
    });
    viewer.addEventListener("mouseleave", () => { readout.hidden = true; });
    form.addEventListener("submit", (ev) => { ev.preventDefault(); offset = 0; load(); });
    document.getElementById("traj-prev").addEventListener("click", () => { offset = Math.max(0, offset - PAGE); load(); });
    document.getElementById("traj-next").addEventListener("click", () => { offset += PAGE; load(); });

    return { load, refreshIfEmpty() { if (!items.length) load(); } };
  }

  return { create };
})();
