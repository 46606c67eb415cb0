// Which session the chat and the completion run on: none (stateless), one made for this chat, or an existing
// one picked from the caller's sessions, whose history is loaded so that a turn appends to it.
import { ApiError, json } from "./api.js";
import { escapeHtml } from "./markdown.js";

const $ = (sel) => document.querySelector(sel);
const current = { id: null };
const listeners = [];

export const mode = () => $("#session-mode").value;
export const id = () => current.id;
export function onLoad(listener) { listeners.push(listener); }

// The X-Session-Id header for the next request; in "new session" mode the first request makes the session.
export async function header() {
  if (mode() === "stateless") return {};
  if (!current.id) {
    if (mode() === "existing") throw new ApiError("pick a session to continue, under Settings");
    current.id = (await json("/v1/sessions", { method: "POST", body: "{}" })).id;
  }
  return { "X-Session-Id": current.id };
}

// The session's history as the server renders it: {text, messages}; messages is null for text that is
// no chat in the model's template.
export async function history() {
  if (!current.id) throw new ApiError("pick a session to continue, under Settings");
  return json("/v1/sessions/" + encodeURIComponent(current.id));
}

// From now on a new session: the conversation on the page is resent whole, so it carries over.
export function startNew() {
  $("#session-mode").value = "new";
  $("#existing-label").hidden = true;
  current.id = null;
}

// A new chat forgets the session made for the old one; a picked session stays picked.
export function reset() {
  if (mode() === "new") current.id = null;
}

export function goneMessage() {
  return "This session no longer exists: it was deleted, it expired, or the server restarted without keeping it.";
}

async function pick(sessionId) {
  current.id = sessionId || null;
  let loaded = null;
  if (current.id) {
    try { loaded = await history(); } catch (err) { loaded = { error: err }; }
  }
  for (const listener of listeners) listener(loaded);
}

$("#session-mode").addEventListener("change", () => {
  $("#existing-label").hidden = mode() !== "existing";
  pick(mode() === "existing" ? $("#existing-session").value : null);
});
$("#existing-session").addEventListener("change", () => pick($("#existing-session").value));

// The caller's persistent sessions, from each status, as the choices to continue.
export function update(status) {
  const select = $("#existing-session"), chosen = select.value;
  const ids = status.sessions.filter((s) => s.persistent).map((s) => s.id);
  const options = ids.map((x) => `<option value="${escapeHtml(x)}">${escapeHtml(x)}</option>`);
  const html = '<option value="">(pick one)</option>' + options.join("");
  if (select.dataset.html !== html) {  // rebuilding an open list would close it under the user's finger
    select.innerHTML = html;
    select.dataset.html = html;
    select.value = ids.includes(chosen) ? chosen : "";
  }
}
