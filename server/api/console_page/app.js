// kvserve's console: a chat and completion playground, and a live view of sessions and the KV pool.
// Plain DOM code, no build step. Model output is text: it is escaped before the few Markdown forms
// below turn into tags, so a reply can never inject markup.
"use strict";

const $ = (sel) => document.querySelector(sel);
const KEY = "kvserve-key";
const state = { messages: [], sessionId: null, turnStarts: [], abort: null, model: null };

// ---- talking to the server -------------------------------------------------------------------
async function api(path, options = {}) {
  const headers = { "content-type": "application/json", ...(options.headers || {}) };
  const key = sessionStorage.getItem(KEY);
  if (key) headers.authorization = "Bearer " + key;
  const r = await fetch(path, { ...options, headers });
  if (r.status === 401) { showKeyForm(key ? "the key was not accepted" : ""); throw new Error("unauthorized"); }
  return r;
}

async function json(path, options) {
  const r = await api(path, options);
  const body = await r.json();
  if (!r.ok) throw new Error(body.error ? body.error.message : r.statusText);
  return body;
}

// Reads an SSE response, calling onEvent with each JSON payload until [DONE].
async function readStream(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const line = buffer.slice(0, cut).trim();
      buffer = buffer.slice(cut + 2);
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      onEvent(JSON.parse(data));
    }
  }
}

// ---- Markdown, safely --------------------------------------------------------------------------
function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

function inline(text) {
  return text.replace(/`([^`]+)`/g, "<code>$1</code>")
    .replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
    .replace(/\*([^*\s][^*]*)\*/g, "<em>$1</em>");
}

function renderMarkdown(source) {
  const parts = escapeHtml(source).split(/```[^\n]*\n?/);
  return parts.map((part, i) => {
    if (i % 2 === 1) return "<pre><code>" + part + "</code></pre>";
    return part.split(/\n{2,}/).filter((p) => p.trim()).map((para) => {
      const lines = para.split("\n");
      if (lines.every((l) => /^\s*[-*] /.test(l))) return "<ul>" + lines.map((l) => "<li>" + inline(l.replace(/^\s*[-*] /, "")) + "</li>").join("") + "</ul>";
      if (/^#{1,6} /.test(para)) return "<p><strong>" + inline(para.replace(/^#+ /, "")) + "</strong></p>";
      return "<p>" + lines.map(inline).join("<br>") + "</p>";
    }).join("");
  }).join("");
}

// ---- the key ---------------------------------------------------------------------------------
function showKeyForm(error) {
  $("#app").hidden = true;
  $("#key-form").hidden = false;
  $("#key-error").textContent = error || "";
}

$("#key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(KEY, $("#key-input").value.trim());
  boot();
});
$("#forget-key").addEventListener("click", () => { sessionStorage.removeItem(KEY); location.reload(); });

// ---- tabs and controls -----------------------------------------------------------------------
document.querySelectorAll(".tab").forEach((tab) => tab.addEventListener("click", () => {
  document.querySelectorAll(".tab").forEach((t) => t.classList.toggle("active", t === tab));
  document.querySelectorAll(".view").forEach((v) => { v.hidden = v.id !== tab.dataset.tab; });
  $("#controls").hidden = tab.dataset.tab === "live";
  $("#app").classList.toggle("wide", tab.dataset.tab === "live");
}));

$("#session-mode").addEventListener("change", () => {
  const mode = $("#session-mode").value;
  $("#existing-label").hidden = mode !== "existing";
  state.sessionId = mode === "existing" ? $("#existing-session").value || null : null;
});
$("#existing-session").addEventListener("change", () => { state.sessionId = $("#existing-session").value || null; });

function sampling() {
  const body = {
    temperature: Number($("#temperature").value), top_p: Number($("#top-p").value),
    max_tokens: Number($("#max-tokens").value), stream: true, stream_options: { include_usage: true },
  };
  if ($("#seed").value !== "") body.seed = Number($("#seed").value);
  const extra = $("#extra").value.trim();
  return extra ? { ...body, ...JSON.parse(extra) } : body;
}

function stats(started, first, usage) {
  const end = performance.now();
  const parts = [];
  if (first) parts.push(`TTFT ${(first - started).toFixed(0)} ms`);
  if (usage) {
    if (first && usage.completion_tokens > 1) parts.push(`${(usage.completion_tokens / ((end - first) / 1000)).toFixed(1)} tokens/s`);
    parts.push(`${usage.completion_tokens} tokens`);
    const cached = usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
    parts.push(`${cached} of ${usage.prompt_tokens} prompt tokens cached`);
  }
  return parts.join(" · ");
}

// ---- chat ------------------------------------------------------------------------------------
function addBubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.innerHTML = '<div class="body"></div><div class="stats"></div>';
  div.querySelector(".body").innerHTML = role === "user" ? "<p>" + escapeHtml(text) + "</p>" : renderMarkdown(text);
  $("#messages").appendChild(div);
  $("#messages").scrollTop = $("#messages").scrollHeight;
  return div;
}

async function sessionHeader() {
  const mode = $("#session-mode").value;
  if (mode === "stateless") return {};
  if (!state.sessionId) {
    if (mode === "existing") throw new Error("pick a session to continue");
    state.sessionId = (await json("/v1/sessions", { method: "POST", body: "{}" })).id;
  }
  return { "X-Session-Id": state.sessionId };
}

async function streamReply() {
  const bubble = addBubble("assistant", "");
  const body = bubble.querySelector(".body");
  const system = $("#system").value.trim();
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...state.messages];
  let text = "", usage = null, first = null, reason = null;
  setBusy(true);
  const started = performance.now();
  try {
    const headers = await sessionHeader();
    if (headers["X-Session-Id"]) state.turnStarts.push((await json("/v1/sessions/" + state.sessionId)).length);
    state.abort = new AbortController();
    const r = await api("/v1/chat/completions", { method: "POST", headers, signal: state.abort.signal,
      body: JSON.stringify({ messages, ...sampling() }) });
    if (!r.ok) throw new Error((await r.json()).error.message);
    await readStream(r, (event) => {
      if (event.error) throw new Error(event.error.message);
      if (event.usage) usage = event.usage;
      for (const choice of event.choices || []) {
        const delta = choice.delta || {};
        if (delta.content) { first = first || performance.now(); text += delta.content; body.innerHTML = renderMarkdown(text); }
        if (choice.finish_reason) reason = choice.finish_reason;
      }
    });
  } catch (err) {
    if (err.name !== "AbortError") bubble.querySelector(".stats").textContent = "error: " + err.message;
  } finally {
    state.abort = null;
    setBusy(false);
  }
  state.messages.push({ role: "assistant", content: text });
  if (!bubble.querySelector(".stats").textContent) {
    bubble.querySelector(".stats").textContent = stats(started, first, usage) + (reason ? ` · ${reason}` : " · stopped");
  }
  $("#regenerate").disabled = false;
}

function setBusy(busy) {
  $("#send").disabled = busy; $("#stop").disabled = !busy; $("#regenerate").disabled = busy;
}

$("#chat-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("#chat-input").value.trim();
  if (!text || state.abort) return;
  $("#chat-input").value = "";
  state.messages.push({ role: "user", content: text });
  addBubble("user", text);
  streamReply();
});
$("#chat-input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("#chat-form").requestSubmit(); }
});
$("#stop").addEventListener("click", () => state.abort && state.abort.abort());
$("#regenerate").addEventListener("click", async () => {
  if (state.messages.at(-1)?.role !== "assistant") return;
  state.messages.pop();
  $("#messages").lastElementChild.remove();
  const start = state.turnStarts.pop();
  if (state.sessionId && start !== undefined) {  // regenerate = rewind the session to before the reply's turn
    await json(`/v1/sessions/${state.sessionId}/rewind`, { method: "POST", body: JSON.stringify({ length: start }) });
  }
  streamReply();
});
$("#clear").addEventListener("click", () => {
  state.messages = []; state.turnStarts = [];
  if ($("#session-mode").value === "new") state.sessionId = null;
  $("#messages").innerHTML = "";
});

// ---- completion --------------------------------------------------------------------------------
$("#complete-go").addEventListener("click", async () => {
  const out = $("#completion");
  out.textContent = "";
  $("#complete-go").disabled = true; $("#complete-stop").disabled = false;
  const started = performance.now();
  let usage = null, first = null;
  try {
    state.abort = new AbortController();
    const r = await api("/v1/completions", { method: "POST", signal: state.abort.signal, headers: await sessionHeader(),
      body: JSON.stringify({ prompt: $("#prompt").value, ...sampling() }) });
    if (!r.ok) throw new Error((await r.json()).error.message);
    await readStream(r, (event) => {
      if (event.usage) usage = event.usage;
      for (const choice of event.choices || []) if (choice.text) { first = first || performance.now(); out.textContent += choice.text; }
    });
    $("#completion-stats").textContent = stats(started, first, usage);
  } catch (err) {
    if (err.name !== "AbortError") $("#completion-stats").textContent = "error: " + err.message;
  } finally {
    state.abort = null;
    $("#complete-go").disabled = false; $("#complete-stop").disabled = true;
  }
});
$("#complete-stop").addEventListener("click", () => state.abort && state.abort.abort());

// ---- live view ---------------------------------------------------------------------------------
const mib = (bytes) => (bytes / 2 ** 20).toFixed(1) + " MiB";
const pct = (part, whole) => (whole ? Math.min(100, (100 * part) / whole) : 0).toFixed(1) + "%";

function renderStatus(s) {
  const p = s.pool, t = s.tenant;
  const tenantText = `${t.tenant}: ${t.running} running · ${t.waiting} queued · ${t.sessions} of ${t.limits.sessions} sessions · ` +
    `${t.tokens_served} tokens served · ${t.rejected} refused · limits ${t.limits.running} running, ${t.limits.queued} queued`;
  if (s.scope === "tenant") {  // a key sees its own share of the pool and its own requests, not the others'
    $("#pool-bar").innerHTML = `<span class="used" style="width:${pct(p.used_blocks, p.blocks)}"></span>`;
    $("#pool-text").textContent = `yours ${mib(t.kv_bytes)} of ${mib(p.budget_bytes)}`;
    $("#requests-text").textContent = tenantText;
    $("#tps-card").hidden = true;
  } else {
    const used = p.used_blocks + p.reserved_blocks;
    $("#pool-bar").innerHTML = `<span class="cached" style="width:${pct(used + p.cached_blocks, p.blocks)}"></span>` +
      `<span class="used" style="width:${pct(used, p.blocks)}"></span>`;
    $("#pool-text").textContent = `used ${mib(used * p.block_bytes)} · cached, free to evict ${mib(p.cached_blocks * p.block_bytes)} · ` +
      `free ${mib(p.free_blocks * p.block_bytes)} of ${mib(p.budget_bytes)} · prefix-cache hit rate ` +
      (p.prefix_cache_hit_rate === null ? "-" : (100 * p.prefix_cache_hit_rate).toFixed(1) + "%") + " · disk tier: " +
      (s.disk === null ? "off" : s.disk.healthy ? `${s.disk.blocks} blocks, ${mib(s.disk.bytes)} of ${mib(s.disk.budget)}, ` +
        `${s.disk.hits} read back` : "failed, RAM only");
    $("#requests-text").textContent = `${s.requests.running} running · ${s.requests.waiting} queued · ` +
      `last step: ${s.steps.last_step_sessions} sessions, ${s.steps.last_step_tokens} tokens` +
      (s.tenants.length > 1 ? " · " + s.tenants.map((x) => `${x.tenant} ${x.running}+${x.waiting}, ${x.tokens_served} tokens`).join(" · ") : "");
    $("#tps-card").hidden = false;
    const sp = s.speculation;
    $("#tps-text").textContent = `${s.steps.tokens_per_s_last_minute} tokens/s on average · speculation ${sp.mode}` +
      (sp.acceptance_rate === null ? "" : `, ${(100 * sp.acceptance_rate).toFixed(1)}% of ${sp.draft_tokens} drafts accepted`);
    drawSparkline(s.steps.tokens_per_s_by_second);
  }
  const rows = s.sessions.map((x) => {
    const alloc = x.sizing === "dynamic" ? `<span class="alloc" style="width:${pct(x.allocated, x.capacity)}"></span>` : "";
    return `<tr data-id="${escapeHtml(x.id)}"><td><code>${escapeHtml(x.id.slice(0, 12))}</code>${x.persistent ? "" : " <span class=muted>(request)</span>"}</td>` +
      `<td>${escapeHtml(x.owner || "-")}</td>` +
      `<td><div class="bar" title="${x.length} of ${x.capacity} tokens">${alloc}<span class="len" style="width:${pct(x.length, x.capacity)}"></span></div>` +
      `<span class="stats">${x.length} / ${x.capacity}</span></td>` +
      `<td>${x.sizing}${x.sizing === "dynamic" ? ` (${x.allocated} allocated)` : ""}</td><td>${mib(x.bytes)}</td>` +
      `<td class="state-${x.state}">${x.state}</td>` +
      (x.persistent ? `<td><button data-act="rewind">rewind</button> <button data-act="fork">fork</button> <button data-act="delete">delete</button></td>` : "<td></td>") +
      "</tr>";
  });
  $("#sessions tbody").innerHTML = rows.join("") || '<tr><td colspan="7" class="muted">no sessions</td></tr>';
  const options = s.sessions.filter((x) => x.persistent).map((x) => `<option value="${escapeHtml(x.id)}">${escapeHtml(x.id)}</option>`);
  const select = $("#existing-session"), chosen = select.value;
  select.innerHTML = '<option value="">(pick one)</option>' + options.join("");
  select.value = chosen;
}

function drawSparkline(values) {
  const canvas = $("#tps"), ctx = canvas.getContext("2d"), top = Math.max(1, ...values);
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  ctx.strokeStyle = "#2f6fde";
  ctx.beginPath();
  values.forEach((v, i) => {
    const x = (i / (values.length - 1)) * canvas.width, y = canvas.height - 2 - (v / top) * (canvas.height - 4);
    i ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
  });
  ctx.stroke();
}

$("#sessions").addEventListener("click", async (e) => {
  const act = e.target.dataset.act;
  if (!act) return;
  const id = e.target.closest("tr").dataset.id;
  try {
    if (act === "delete") await json("/v1/sessions/" + id, { method: "DELETE" });
    if (act === "fork") await json(`/v1/sessions/${id}/fork`, { method: "POST", body: "{}" });
    if (act === "rewind") {
      const length = window.prompt("Keep how many tokens of the history?");
      if (length !== null) await json(`/v1/sessions/${id}/rewind`, { method: "POST", body: JSON.stringify({ length: Number(length) }) });
    }
    if (act === "delete" && state.sessionId === id) state.sessionId = null;
  } catch (err) {
    window.alert(err.message);
  }
  refresh();
});

async function refresh() {
  try {
    renderStatus(await json("/v1/status"));
  } catch (err) {
    if (err.message !== "unauthorized") $("#requests-text").textContent = "status unavailable: " + err.message;
  }
}

// ---- start ---------------------------------------------------------------------------------------
let timer = null;
async function boot() {
  try {
    const status = await json("/v1/status");
    $("#key-form").hidden = true;
    $("#app").hidden = false;
    $("#forget-key").hidden = !sessionStorage.getItem(KEY);
    $("#model").textContent = status.model;
    renderStatus(status);
    if (!timer) timer = setInterval(refresh, 1000);
  } catch (err) {
    if (err.message !== "unauthorized") showKeyForm("the server did not answer: " + err.message);
  }
}

boot();
