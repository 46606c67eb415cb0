// The chat. Each send resends the conversation on the page and the server keeps what it already holds of
// it, so a session is continued, never overwritten, as long as the page shows its turns. A turn that
// failed stays on the page, marked, and is never resent: it can be retried or removed. A reply the server's
// shutdown cut short is kept and sent on, marked, with a Retry that asks for the whole reply again.
import { api, failure, json, readStream } from "./api.js";
import * as connection from "./connection.js";
import { replyStats } from "./format.js";
import { escapeHtml, renderMarkdown } from "./markdown.js";
import * as sessions from "./sessions.js";
import * as settings from "./settings.js";

const $ = (sel) => document.querySelector(sel);
const FOLLOW_SLACK_PX = 40;  // this close to the bottom still counts as reading the newest text
// An entry is one message: {role, content, el, state}; state is "ok" (sent with every turn), "pending",
// "failed" or "dropped" (shown, never sent). A reply entry names its question in `user`.
const chat = { entries: [], abort: null, textOnly: false };

// `busy`: a hint about the reply in flight, which goes when the reply ends
function hint(text, busy = false) {
  $("#chat-hint").textContent = text;
  $("#chat-hint").dataset.busy = busy ? "1" : "";
}

function bubble(role, html) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.innerHTML = '<div class="body"></div><div class="stats"></div><div class="actions"></div>';
  div.querySelector(".body").innerHTML = html;
  $("#messages").appendChild(div);
  return div;
}

function add(role, content, state) {
  const entry = { role, content, state, el: bubble(role, role === "user" ? "<p>" + escapeHtml(content) + "</p>" : renderMarkdown(content)) };
  chat.entries.push(entry);
  return entry;
}

function remove(entry) {
  entry.el.remove();
  chat.entries = chat.entries.filter((e) => e !== entry);
}

// Follows a streaming reply only while the reader is at the bottom: scrolling up to read stops it.
function follow(change) {
  const list = $("#messages");
  const atBottom = list.scrollHeight - list.scrollTop - list.clientHeight < FOLLOW_SLACK_PX;
  change();
  if (atBottom) list.scrollTop = list.scrollHeight;
}

function toBottom() { $("#messages").scrollTop = $("#messages").scrollHeight; }

function messagesFor(question) {
  const system = $("#system").value.trim();
  const out = system ? [{ role: "system", content: system }] : [];
  for (const e of chat.entries) {
    if (e === question) break;
    if (e.state === "ok") out.push({ role: e.role, content: e.content });
  }
  return [...out, { role: "user", content: question.content }];
}

function setBusy(busy) {
  $("#send").disabled = busy;
  $("#stop").disabled = !busy;
  const last = chat.entries.at(-1);
  $("#regenerate").disabled = busy || !(last && last.user && last.state === "ok");
  if (!busy && $("#chat-hint").dataset.busy) hint("");
}

function send(text) {
  if (chat.abort) { hint("A reply is still coming: wait for it, or press Stop.", true); return false; }
  if (chat.textOnly) { hint("This session holds text, not chat turns: continue it in Completion, or start a New chat."); return false; }
  let params;
  try { params = settings.read(); } catch (err) { settings.show(err); return false; }
  hint("");
  const question = add("user", text, "pending");
  toBottom();
  run(question, params);
  return true;
}

async function run(question, params) {
  const reply = add("assistant", "", "pending");
  reply.user = question;
  toBottom();
  const body = reply.el.querySelector(".body");
  let text = "", usage = null, first = null, reason = null;
  chat.abort = new AbortController();
  setBusy(true);
  const started = performance.now();
  try {
    const headers = await sessions.header();
    const r = await api("/v1/chat/completions", { method: "POST", headers, signal: chat.abort.signal,
      body: JSON.stringify({ messages: messagesFor(question), ...params }) });
    if (!r.ok) throw await failure(r);
    await readStream(r, (event) => {
      if (event.usage) usage = event.usage;
      for (const choice of event.choices || []) {
        const delta = choice.delta || {};
        if (delta.content) {
          first = first || performance.now();
          text += delta.content;
          follow(() => { body.innerHTML = renderMarkdown(text); });
        }
        if (choice.finish_reason) reason = choice.finish_reason;
      }
    });
  } catch (err) {
    if (err.name !== "AbortError" || !text) {
      chat.abort = null;
      fail(question, reply, err.name === "AbortError" ? new Error("stopped before the reply began") : err);
      setBusy(false);
      return;
    }
  }
  chat.abort = null;
  question.state = reply.state = "ok";
  reply.content = text;
  const stats = reply.el.querySelector(".stats");
  follow(() => {
    // "abort": the server's drain ended the reply (its shutdown), not the model nor the user
    stats.textContent = replyStats(started, first, usage) + " · " + (reason === "abort" ?
      "cut short: the server shut down before the reply ended" : reason || "stopped");
    if (reason === "abort") cutShort(question, reply);
  });
  setBusy(false);
}

function cutShort(question, reply) {
  reply.el.classList.add("cut");
  reply.el.querySelector(".stats").classList.add("warn");
  addButton(reply, "Retry", () => retry(question, reply));
}

// A prompt too long for its session, as the server words it -> whether a prompt of `count` tokens fits.
function limitOf(err) {
  let m = /prompt of \d+ tokens plus max_tokens (\d+) exceeds the session capacity of (\d+)/.exec(err.message || "");
  if (m) return (count) => count + Number(m[1]) <= Number(m[2]);
  m = /prompt of \d+ tokens exceeds the limit of (\d+)/.exec(err.message || "");
  return m ? (count) => count <= Number(m[1]) : null;
}

// The fewest whole turns, oldest first, whose dropping lets the question fit, counted by the server's own
// template and tokenizer; null when the question alone does not fit.
async function turnsToDrop(question, fits) {
  const sent = chat.entries.slice(0, chat.entries.indexOf(question)).filter((e) => e.state === "ok");
  const cuts = [...sent.keys()].filter((i) => i > 0 && sent[i].role === "user").concat(sent.length);
  for (const cut of cuts) {
    const messages = [...messagesFor(question).filter((m) => m.role === "system"),
      ...sent.slice(cut).map((e) => ({ role: e.role, content: e.content })), { role: "user", content: question.content }];
    const { count } = await json("/tokenize", { method: "POST", body: JSON.stringify({ messages }) });
    if (fits(count)) return sent.slice(0, cut);
  }
  return null;
}

function addButton(entry, label, act) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.addEventListener("click", () => { if (!chat.abort) act(); });
  entry.el.querySelector(".actions").appendChild(b);
}

function fail(question, reply, err) {
  follow(() => failed(question, reply, err));
}

function failed(question, reply, err) {
  question.state = reply.state = "failed";
  question.el.classList.add("failed");
  reply.el.classList.add("failed");
  const stats = reply.el.querySelector(".stats");
  stats.className = "stats error";
  stats.textContent = err.sessionGone ? sessions.goneMessage() : "error: " + err.message;
  if (err.sessionGone) addButton(reply, "Start a new session", () => { sessions.startNew(); retry(question, reply); });
  addButton(reply, "Retry", () => retry(question, reply));
  addButton(reply, "Remove", () => { remove(question); remove(reply); setBusy(false); });
  if (err.unreachable) connection.check();
  const fits = limitOf(err);
  if (fits && chat.entries.some((e) => e.state === "ok")) offerRoom(question, reply, fits).catch(() => {});
}

// A history that no longer fits: start over with the question alone, or drop the oldest turns it needs.
async function offerRoom(question, reply, fits) {
  const dropped = await turnsToDrop(question, fits);
  follow(() => offer(question, reply, dropped));
}

function offer(question, reply, dropped) {
  const stats = reply.el.querySelector(".stats");
  if (dropped === null) { stats.textContent += ". This message alone is too long for the session."; return; }
  const turns = dropped.filter((e) => e.role === "user").length || 1;
  stats.textContent += ". The conversation no longer fits: start over, or drop its oldest turns.";
  addButton(reply, `Drop ${turns === 1 ? "the oldest turn" : `the ${turns} oldest turns`}`, () => {
    for (const e of dropped) {
      e.state = "dropped";
      e.el.classList.add("dropped");
      e.el.querySelector(".stats").textContent = "dropped: no longer sent";
    }
    retry(question, reply);
  });
  addButton(reply, "Start over", () => startOver(question));
}

function retry(question, reply) {
  remove(question);
  remove(reply);
  send(question.content);
}

function startOver(question) {
  if (sessions.mode() === "existing") sessions.startNew();  // never overwrite the session that was picked
  clear();
  send(question.content);
}

function clear() {
  if (chat.abort) chat.abort.abort();
  chat.entries = [];
  chat.textOnly = false;
  $("#messages").innerHTML = "";
  $("#session-note").hidden = true;
  hint("");
  sessions.reset();
  setBusy(false);
}

// A picked session's history: its turns as messages, or its text when it is no chat.
sessions.onLoad((loaded) => {
  clear();
  const note = $("#session-note");
  if (loaded === null) return;
  if (loaded.error) {
    note.className = "notice error";
    note.textContent = loaded.error.sessionGone ? sessions.goneMessage() : "error: " + loaded.error.message;
    note.hidden = false;
    return;
  }
  if (loaded.messages === null) {
    chat.textOnly = true;
    note.className = "notice";
    note.innerHTML = "This session holds text, not chat turns: continue it in Completion, which appends to it." +
      `<pre class="history">${escapeHtml(loaded.text)}</pre>`;
    note.hidden = false;
    return;
  }
  let question = null;
  for (const m of loaded.messages) {
    if (m.role === "system") { $("#system").value = m.content; continue; }
    const entry = add(m.role, m.content, "ok");
    if (m.role === "user") question = entry;
    else entry.user = question;
  }
  toBottom();
  setBusy(false);
});

$("#chat-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("#chat-input").value.trim();
  if (!text) { hint("Write a message first."); return; }
  if (send(text)) $("#chat-input").value = "";
});
$("#chat-input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("#chat-form").requestSubmit(); }
});
$("#stop").addEventListener("click", () => chat.abort && chat.abort.abort());
$("#regenerate").addEventListener("click", () => {
  const last = chat.entries.at(-1);
  if (chat.abort || !last || !last.user || last.state !== "ok") return;
  let params;
  try { params = settings.read(); } catch (err) { settings.show(err); return; }
  remove(last);
  last.user.state = "pending";
  run(last.user, params);
});
$("#clear").addEventListener("click", clear);
