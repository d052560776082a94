"use strict";
(() => {
  if (!Taper.initChrome()) return;
  const form = document.getElementById("submit-form");
  const errorList = document.getElementById("error-details");

  Taper.api("/v1/environments").then((envs) => {
    const select = document.getElementById("env-select");
    select.replaceChildren(...envs.map((e) => Taper.el("option", { value: e.name }, e.name)));
    select.value = envs.some((e) => e.name === "calculator") ? "calculator" : (envs[0] || {}).name;
  }).catch((e) => Taper.showError("error", e));

  // The recommended schedule decays over the whole run: the horizon follows Total steps until edited.
  const totalSteps = document.getElementById("total-steps");
  const horizon = document.getElementById("schedule-horizon");
  horizon.addEventListener("input", () => { horizon.dataset.edited = "1"; });
  totalSteps.addEventListener("input", () => { if (!horizon.dataset.edited) horizon.value = totalSteps.value; });

  function setPath(obj, path, value) {
    const parts = path.split(".");
    let cur = obj;
    for (const p of parts.slice(0, -1)) cur = cur[p] = cur[p] || {};
    cur[parts[parts.length - 1]] = value;
  }

  function merge(into, from) {
    for (const [k, v] of Object.entries(from)) {
      if (v && typeof v === "object" && !Array.isArray(v) && into[k] && typeof into[k] === "object") merge(into[k], v);
      else into[k] = v;
    }
    return into;
  }

  function buildSpec() {
    const spec = {};
    for (const input of form.querySelectorAll("[data-field]")) {
      if (input.id === "extra-json") continue;
      const value = Taper.readInput(input, input.dataset.field);
      if (value !== undefined) setPath(spec, input.dataset.field, value);
    }
    const extra = document.getElementById("extra-json").value.trim();
    if (extra) {
      let parsed;
      try { parsed = JSON.parse(extra); } catch (e) {
        const err = new Error(`extra JSON: ${e.message}`); err.field = "body"; throw err;
      }
      merge(spec, parsed);
    }
    return spec;
  }

  function mark(fields) {
    for (const input of form.querySelectorAll("[data-field]")) {
      input.classList.toggle("invalid", fields.some((f) => f && (f === input.dataset.field || f.startsWith(input.dataset.field + "."))));
    }
  }

  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    Taper.showError("error", null);
    errorList.replaceChildren();
    mark([]);
    let spec;
    try { spec = buildSpec(); } catch (e) { Taper.showError("error", e); mark([e.field]); return; }
    try {
      const job = await Taper.api("/v1/jobs", { method: "POST", body: spec });
      location.assign(`/ui/jobs/${encodeURIComponent(job.id)}`);
    } catch (e) {
      Taper.showError("error", e);
      const details = e.details && e.details.length ? e.details : [{ field: e.field, message: e.message }];
      errorList.replaceChildren(...details.map((d) => Taper.el("li", {}, Taper.el("code", {}, d.field || "body"), " ", d.message)));
      mark(details.map((d) => d.field));
    }
  });
})();
