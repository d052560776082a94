// Shared by every dashboard page: the API key, calls to the REST API, the SSE reader and small DOM helpers.
// Job data (model output, tool results, names) is always inserted as text, never as HTML.
"use strict";

const Taper = (() => {
  const KEY = "taper.apiKey";

  class ApiError extends Error {
    constructor(status, body) {
      const err = (body && body.error) || {};
      super(err.message || `HTTP ${status}`);
      this.status = status;
      this.code = err.code || "http_error";
      this.field = err.field || null;
      this.details = err.details || [];
    }
  }

  const key = () => sessionStorage.getItem(KEY);
  const setKey = (k) => sessionStorage.setItem(KEY, k);
  const clearKey = () => sessionStorage.removeItem(KEY);

  function toLogin(message) {
    const next = location.pathname + location.search;
    if (message) sessionStorage.setItem("taper.loginMessage", message);
    location.assign("/ui/login?next=" + encodeURIComponent(next));
  }

  function authHeaders(extra) {
    const headers = Object.assign({}, extra || {});
    const k = key();
    if (k) headers["Authorization"] = "Bearer " + k;
    return headers;
  }

  async function api(path, opts = {}) {
    const init = { method: opts.method || "GET", headers: authHeaders(opts.headers), signal: opts.signal };
    if (opts.body !== undefined) {
      init.body = typeof opts.body === "string" ? opts.body : JSON.stringify(opts.body);
      init.headers["Content-Type"] = "application/json";
    }
    const res = await fetch(path, init);
    const text = await res.text();
    let body = null;
    try { body = text ? JSON.parse(text) : null; } catch (_) { body = null; }
    if (res.status === 401 && !opts.noRedirect) {
      clearKey();
      toLogin((body && body.error && body.error.message) || "please log in");
      throw new ApiError(401, body);
    }
    if (!res.ok) throw new ApiError(res.status, body);
    return body;
  }

  // Server-sent events over fetch (EventSource cannot send an Authorization header). Replays from `after`,
  // reconnects with Last-Event-ID until `shouldReconnect()` says the stream is over or `signal` aborts.
  function streamEvents(path, { after = null, onEvent, onStatus, shouldReconnect, signal }) {
    let lastId = after;
    const status = (s) => onStatus && onStatus(s);

    async function once() {
      const headers = authHeaders({ Accept: "text/event-stream" });
      if (lastId) headers["Last-Event-ID"] = lastId;
      const res = await fetch(path, { headers, signal, cache: "no-store" });
      if (res.status === 401) { clearKey(); toLogin("please log in"); return false; }
      if (!res.ok || !res.body) throw new Error(`event stream: HTTP ${res.status}`);
      status("live");
      const reader = res.body.getReader();
      const decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
        let cut;
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          const ev = { id: null, event: "message", data: [] };
          for (const line of block.split("\n")) {
            if (!line || line.startsWith(":")) continue;
            const i = line.indexOf(":");
            const field = i < 0 ? line : line.slice(0, i);
            const val = i < 0 ? "" : line.slice(i + 1).replace(/^ /, "");
            if (field === "id") ev.id = val;
            else if (field === "event") ev.event = val;
            else if (field === "data") ev.data.push(val);
          }
          if (!ev.data.length) continue;  // a ping
          if (ev.id) lastId = ev.id;
          let data;
          try { data = JSON.parse(ev.data.join("\n")); } catch (_) { data = ev.data.join("\n"); }
          onEvent({ id: ev.id, kind: ev.event, data });
        }
      }
      return true;
    }

    (async () => {
      let delay = 500;
      for (;;) {
        if (signal && signal.aborted) return;
        try {
          if ((await once()) === false) return;
          delay = 500;
        } catch (e) {
          if (signal && signal.aborted) return;
          status("reconnecting");
        }
        if (shouldReconnect && !shouldReconnect()) { status("ended"); return; }
        await new Promise((r) => setTimeout(r, delay));
        delay = Math.min(delay * 2, 5000);
      }
    })();
    return { lastId: () => lastId };
  }

  // el("td", {class: "x", title: "..."}, "text", childNode, ...): strings become text nodes.
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "dataset") Object.assign(node.dataset, v);
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  }

  function showError(target, err) {
    const box = typeof target === "string" ? document.getElementById(target) : target;
    if (!box) return;
    if (!err) { box.hidden = true; box.textContent = ""; return; }
    box.hidden = false;
    box.textContent = err.field ? `${err.message} (field: ${err.field})` : String(err.message || err);
  }

  const fmtTime = (ts) => (ts ? new Date(ts * 1000).toLocaleString() : "—");
  function fmtNum(x, digits = 4) {
    if (x === null || x === undefined || Number.isNaN(x)) return "—";
    if (typeof x !== "number") return String(x);
    if (Number.isInteger(x)) return String(x);
    const a = Math.abs(x);
    return a !== 0 && (a < 1e-3 || a >= 1e5) ? x.toExponential(2) : x.toFixed(digits).replace(/\.?0+$/, "");
  }

  function stateBadge(state) {
    return el("span", { class: `badge state-${state}`, "data-state": state }, state);
  }

  // Reads an input per its data-type; undefined for an empty optional field. Throws naming the field.
  function readInput(input, name) {
    const raw = input.value.trim();
    if (raw === "") return undefined;
    const type = input.dataset.type || "string";
    const bad = (what) => { const e = new Error(`${name}: ${what}`); e.field = name; throw e; };
    if (type === "int") { const v = Number(raw); if (!Number.isInteger(v)) bad("must be a whole number"); return v; }
    if (type === "float") { const v = Number(raw); if (!Number.isFinite(v)) bad("must be a number"); return v; }
    if (type === "intlist") {
      return raw.split(/[\s,]+/).filter(Boolean).map((s) => {
        const v = Number(s); if (!Number.isInteger(v)) bad(`'${s}' is not a whole number`); return v;
      });
    }
    if (type === "points") {
      return raw.split(/[\s,]+/).filter(Boolean).map((pair) => {
        const [s, w] = pair.split(":").map(Number);
        if (!Number.isInteger(s) || !Number.isFinite(w)) bad(`'${pair}' is not step:weight`);
        return [s, w];
      });
    }
    return raw;
  }

  function formatInput(value, type) {
    if (value === null || value === undefined) return "";
    if (type === "intlist") return value.join(", ");
    if (type === "points") return value.map(([s, w]) => `${s}:${w}`).join(", ");
    return String(value);
  }

  function initChrome() {
    const page = document.body.dataset.page;
    if (!document.body.dataset.public && !key()) { toLogin(); return false; }
    for (const a of document.querySelectorAll("[data-nav]")) {
      if (a.dataset.nav === page) a.classList.add("active");
    }
    const hint = document.getElementById("key-hint");
    if (hint && key()) hint.textContent = "key …" + key().slice(-4);
    const out = document.getElementById("logout");
    if (out) out.addEventListener("click", () => { clearKey(); location.assign("/ui/login"); });
    return true;
  }

  return { ApiError, api, key, setKey, clearKey, toLogin, streamEvents, el, showError, fmtTime, fmtNum,
           stateBadge, readInput, formatInput, initChrome };
})();
