// The one place that says whether the console is connected: it reads GET /v1/status once a second while
// the server answers, backs off while it does not, and tells its listeners each status and each change.
// States: "connecting" (before the first answer), "live", "reconnecting", "unreachable", and "key" while
// the server waits for an API key.
import { json } from "./api.js";

const $ = (sel) => document.querySelector(sel);
const LIVE_MS = 1000, MAX_BACKOFF_MS = 8000, UNREACHABLE_AFTER = 3;
const conn = { state: "connecting", failures: 0, timer: null, seq: 0, running: false, lastSeen: null, onStatus: null };
const listeners = [];

export const state = () => conn.state;
export const lastSeen = () => conn.lastSeen;
export function watch(listener) { listeners.push(listener); }

export function start(onStatus) {
  conn.onStatus = onStatus;
  conn.running = true;
  poll();
}

export function stop(next = null) {
  conn.running = false;
  clearTimeout(conn.timer);
  if (next) set(next, "");
}

// A request elsewhere found the server gone: look now rather than at the next tick.
export function check() {
  if (conn.running) poll();
}

async function poll() {
  clearTimeout(conn.timer);
  const seq = ++conn.seq;  // a newer poll makes an older one's answer moot
  try {
    const status = await json("/v1/status");
    if (seq !== conn.seq || !conn.running) return;
    conn.failures = 0;
    conn.lastSeen = new Date();
    set("live", "");
    conn.onStatus(status);
    schedule(LIVE_MS);
  } catch (err) {
    if (seq !== conn.seq || !conn.running) return;
    if (err.status === 401) { stop(); return; }  // the key form takes over
    conn.failures += 1;
    set(conn.failures >= UNREACHABLE_AFTER ? "unreachable" : "reconnecting", err.unreachable ? "" : err.message);
    schedule(Math.min(MAX_BACKOFF_MS, LIVE_MS * 2 ** (conn.failures - 1)));
  }
}

function schedule(ms) {
  clearTimeout(conn.timer);
  if (conn.running) conn.timer = setTimeout(poll, ms);
}

const WORDS = { connecting: "connecting", live: "live", key: "waiting for a key", reconnecting: "reconnecting, retrying",
  unreachable: "server unreachable, retrying" };

function set(next, reason) {
  $("#connection-text").textContent = WORDS[next] + (reason ? ` (${reason})` : "");
  $("#retry-now").hidden = !["reconnecting", "unreachable"].includes(next);
  if (next === conn.state) return;
  conn.state = next;
  document.body.dataset.connection = next;
  for (const listener of listeners) listener(next);
}

$("#retry-now").addEventListener("click", check);
