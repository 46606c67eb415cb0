// The live view: the KV pool, requests, output tokens/s and the caller's sessions, from each status. While
// the connection is down its figures are greyed and dated: they are the last ones the server gave.
import { json } from "./api.js";
import * as connection from "./connection.js";
import { clock, mib, niceCeil, pct, plural } from "./format.js";
import { escapeHtml } from "./markdown.js";

const $ = (sel) => document.querySelector(sel);

function tenantLine(t) {
  return `${t.tenant}: ${t.running} running · ${t.waiting} queued · ${t.sessions} of ${plural(t.limits.sessions, "session")} · ` +
    `${plural(t.tokens_served, "token")} served · ${t.rejected} refused · limits ${t.limits.running} running, ${t.limits.queued} queued`;
}

function renderPool(s) {
  const p = s.pool, t = s.tenant;
  if (s.scope === "tenant") {  // a key sees its own share of the pool and its own requests, not the others'
    $("#pool-bar").innerHTML = `<span class="used" style="width:${pct(p.used_blocks, p.blocks)}"></span>`;
    $("#pool-text").textContent = `yours ${mib(t.kv_bytes)} of ${mib(p.budget_bytes)}`;
    $("#requests-text").textContent = tenantLine(t);
    return;
  }
  const used = p.used_blocks + p.reserved_blocks;
  $("#pool-bar").innerHTML = `<span class="cached" style="width:${pct(used + p.cached_blocks, p.blocks)}"></span>` +
    `<span class="used" style="width:${pct(used, p.blocks)}"></span>`;
  $("#pool-text").textContent = `used ${mib(used * p.block_bytes)} · cached, free to evict ${mib(p.cached_blocks * p.block_bytes)} · ` +
    `free ${mib(p.free_blocks * p.block_bytes)} of ${mib(p.budget_bytes)} · prefix-cache hit rate ` +
    (p.prefix_cache_hit_rate === null ? "-" : (100 * p.prefix_cache_hit_rate).toFixed(1) + "%") + " · disk tier: " +
    (s.disk === null ? "off" : s.disk.healthy ? `${s.disk.blocks} blocks, ${mib(s.disk.bytes)} of ${mib(s.disk.budget)}, ` +
      `${s.disk.hits} read back` : "failed, RAM only");
  $("#requests-text").textContent = `${s.requests.running} running · ${s.requests.waiting} queued · ` +
    `last step: ${plural(s.steps.last_step_sessions, "session")}, ${plural(s.steps.last_step_tokens, "token")}` +
    (s.tenants.length > 1 ? " · " + s.tenants.map((x) => `${x.tenant} ${x.running}+${x.waiting}, ${plural(x.tokens_served, "token")}`).join(" · ") : "");
}

// The server's rate for an operator, the caller's own for a key holder: now, the minute's mean, and its
// sparkline with a labelled scale.
function renderThroughput(s) {
  const own = s.scope === "tenant", rates = own ? s.tenant.throughput : s.steps;
  $("#tps-title").textContent = own ? "Your output tokens/s" : "Output tokens/s";
  $("#tps-now").textContent = `now ${rates.tokens_per_s_now.toFixed(1)}`;
  $("#tps-avg").textContent = `(last ${rates.now_window_s} s) · last minute ${rates.tokens_per_s_last_minute.toFixed(1)} on average`;
  const sp = s.speculation;
  $("#tps-text").textContent = sp ? `speculation ${sp.mode}` + (sp.acceptance_rate === null ? "" :
    `, ${(100 * sp.acceptance_rate).toFixed(1)}% of ${sp.draft_tokens} drafts accepted`) : "";
  const top = niceCeil(Math.max(...rates.tokens_per_s_by_second));
  $("#tps-top").textContent = `${top}`;
  drawSparkline(rates.tokens_per_s_by_second, top);
}

function drawSparkline(values, top) {
  const canvas = $("#tps"), ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  ctx.strokeStyle = "#d9dde5";
  ctx.strokeRect(0.5, 0.5, canvas.width - 1, canvas.height - 1);
  ctx.strokeStyle = "#2f6fde";
  ctx.beginPath();
  values.forEach((v, i) => {
    const x = (i / (values.length - 1)) * canvas.width, y = canvas.height - 2 - (v / top) * (canvas.height - 4);
    i ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
  });
  ctx.stroke();
}

function cell(label, html, cls = "") {
  return `<td data-label="${label}"${cls ? ` class="${cls}"` : ""}>${html}</td>`;
}

function renderSessions(s) {
  $("#sessions-count").textContent = plural(s.sessions.length, "session");
  const rows = s.sessions.map((x) => {
    const alloc = x.sizing === "dynamic" ? `<span class="alloc" style="width:${pct(x.allocated, x.capacity)}"></span>` : "";
    return `<tr data-id="${escapeHtml(x.id)}">` +
      cell("session", `<code>${escapeHtml(x.id.slice(0, 12))}</code>${x.persistent ? "" : " <span class=muted>(request)</span>"}`) +
      cell("owner", escapeHtml(x.owner || "-")) +
      cell("length", `<div class="bar" title="${x.length} of ${x.capacity} tokens">${alloc}<span class="len" style="width:${pct(x.length, x.capacity)}"></span></div>` +
        `<span class="stats">${x.length} / ${x.capacity}</span>`) +
      cell("sizing", x.sizing + (x.sizing === "dynamic" ? ` (${x.allocated} allocated)` : "")) +
      cell("bytes", mib(x.bytes)) +
      cell("state", x.state, `state state-${x.state}`) +
      cell("actions", x.persistent ? '<button data-act="rewind">rewind</button> <button data-act="fork">fork</button> <button data-act="delete">delete</button>' : "", "acts") +
      "</tr>";
  });
  $("#sessions tbody").innerHTML = rows.join("") || '<tr><td colspan="7" class="muted">no sessions</td></tr>';
}

export function render(s) {
  renderPool(s);
  renderThroughput(s);
  renderSessions(s);
}

function liveError(text) {
  $("#live-error").textContent = text;
  $("#live-error").hidden = !text;
}

async function act(action, id, row) {
  const path = "/v1/sessions/" + encodeURIComponent(id);
  if (action === "delete") return json(path, { method: "DELETE" });
  if (action === "fork") return json(path + "/fork", { method: "POST", body: "{}" });
  const length = row.querySelector("td[data-label=length] .stats").textContent.split(" / ")[0];
  const answer = window.prompt(`Keep how many tokens of the history (0 to ${length})?`);
  if (answer === null) return null;
  const keep = Number(answer.trim());
  if (answer.trim() === "" || !Number.isInteger(keep) || keep < 0 || keep > Number(length)) {
    throw new Error(`rewind: a whole number from 0 to ${length}, not "${answer}"`);
  }
  return json(path + "/rewind", { method: "POST", body: JSON.stringify({ length: keep }) });
}

$("#sessions").addEventListener("click", async (e) => {
  const action = e.target.dataset.act;
  if (!action) return;
  const row = e.target.closest("tr");
  liveError("");
  try {
    await act(action, row.dataset.id, row);
  } catch (err) {
    liveError(`${action} failed: ${err.message}`);
  }
  connection.check();
});

// A persistent session of the server's default size, to continue from the chat or the completion
$("#new-session").addEventListener("click", async () => {
  liveError("");
  $("#live-note").textContent = "";
  try {
    const made = await json("/v1/sessions", { method: "POST", body: "{}" });
    $("#live-note").textContent = `Made session ${made.id}: pick it in the chat, under Settings, to continue it.`;
  } catch (err) {
    liveError(`new session failed: ${err.message}`);
  }
  connection.check();
});

connection.watch((state) => {
  const note = $("#stale-note");
  note.hidden = state !== "reconnecting" && state !== "unreachable";
  const seen = connection.lastSeen();
  note.textContent = "Not connected: these are the last figures the server gave" + (seen ? `, at ${clock(seen)}` : "") +
    ". They may be out of date.";
});
