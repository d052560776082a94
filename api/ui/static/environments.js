"use strict";
(() => {
  if (!Taper.initChrome()) return;
  const { el } = Taper;

  function details(env) {
    if (env.builtin) return el("span", { class: "muted" }, "built-in");
    const reg = env.registration || {};
    const target = reg.kind === "http" || reg.kind === "mcp" ? reg.base_url || "" : reg.import_path || "";
    const declared = [reg.grader ? `grader: ${reg.grader.type}` : "",
      (reg.process_rewards || []).length ? `${reg.process_rewards.length} process components` : ""];
    const summary = [target, ...declared].filter(Boolean).join(" · ");
    return el("details", {}, el("summary", {}, summary || "registration"),
      el("pre", { class: "mono small" }, JSON.stringify(reg, null, 2)));
  }

  Taper.api("/v1/environments").then((envs) => {
    document.querySelector("#env-table tbody").replaceChildren(...envs.map((env) => el("tr", { "data-env": env.name },
      el("td", {}, env.name),
      el("td", {}, env.builtin ? "built-in" : (env.registration || {}).kind || ""),
      el("td", {}, details(env)))));
  }).catch((e) => Taper.showError("error", e));
})();
