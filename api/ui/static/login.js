"use strict";
(() => {
  Taper.initChrome();
  const form = document.getElementById("login-form");
  const note = sessionStorage.getItem("taper.loginMessage");
  if (note) { Taper.showError("error", { message: note }); sessionStorage.removeItem("taper.loginMessage"); }
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const k = document.getElementById("api-key").value.trim();
    if (!k) return;
    // Check the key before keeping it: any authenticated read will do.
    const res = await fetch("/v1/jobs?limit=1", { headers: { Authorization: "Bearer " + k } });
    if (!res.ok) {
      let msg = `HTTP ${res.status}`;
      try { msg = (await res.json()).error.message; } catch (_) { /* keep the status */ }
      Taper.showError("error", { message: msg });
      return;
    }
    Taper.setKey(k);
    const next = new URLSearchParams(location.search).get("next");
    location.assign(next && next.startsWith("/ui/") ? next : "/ui/jobs");
  });
})();
