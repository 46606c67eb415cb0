// Completion: a prompt continued as text. On a picked session the prompt follows the session's whole text,
// which the server keeps, so the completion appends to its history.
import { api, failure, readStream } from "./api.js";
import * as connection from "./connection.js";
import { replyStats } from "./format.js";
import * as sessions from "./sessions.js";
import * as settings from "./settings.js";

const $ = (sel) => document.querySelector(sel);
const run = { abort: null };

function report(text, error, action) {
  const stats = $("#completion-stats");
  stats.className = error ? "stats error" : "stats";
  stats.textContent = text;
  if (action) {
    const b = document.createElement("button");
    b.type = "button";
    [b.textContent, b.onclick] = action;
    stats.append(" ", b);
  }
}

function showHistory(text) {
  $("#complete-history").textContent = text || "";
  $("#complete-history").hidden = !text;
}

async function complete() {
  if (run.abort) return;
  let params;
  try { params = settings.read(); } catch (err) { settings.show(err); return; }
  const typed = $("#prompt").value, continuing = sessions.mode() === "existing";
  if (!typed && !continuing) { report("Write a prompt first.", true); return; }
  const out = $("#completion");
  out.textContent = "";
  report("", false);
  run.abort = new AbortController();
  $("#complete-go").disabled = true; $("#complete-stop").disabled = false;
  let usage = null, first = null, reason = null;
  try {
    let before = "";
    if (continuing) {
      before = (await sessions.history()).text;
      showHistory(before);
    }
    const started = performance.now();
    const r = await api("/v1/completions", { method: "POST", signal: run.abort.signal, headers: await sessions.header(),
      body: JSON.stringify({ prompt: before + typed, ...params }) });
    if (!r.ok) throw await failure(r);
    out.textContent = typed;
    await readStream(r, (event) => {
      if (event.usage) usage = event.usage;
      for (const choice of event.choices || []) {
        if (choice.text) { first = first || performance.now(); out.textContent += choice.text; }
        if (choice.finish_reason) reason = choice.finish_reason;
      }
    });
    report(replyStats(started, first, usage) + ` · ${reason || "stopped"}`, false);
  } catch (err) {
    if (err.name === "AbortError") report("stopped", false);
    else if (err.sessionGone) report(sessions.goneMessage(), true, ["Start a new session", () => { sessions.startNew(); showHistory(""); complete(); }]);
    else report("error: " + err.message, true);
    if (err.unreachable) connection.check();
  } finally {
    run.abort = null;
    $("#complete-go").disabled = false; $("#complete-stop").disabled = true;
  }
}

$("#complete-go").addEventListener("click", complete);
$("#complete-stop").addEventListener("click", () => run.abort && run.abort.abort());
sessions.onLoad((loaded) => showHistory(loaded && !loaded.error ? loaded.text : ""));
