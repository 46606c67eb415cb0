// Talking to the server: every request carries the key, and every failure becomes an ApiError, in the
// server's own words (its JSON error shape) or, when nothing answered, in plain words about the connection.
const KEY = "kvserve-key";
const ANSWER_MS = 10000;  // a request that has not begun to answer by then counts as unreachable

export class ApiError extends Error {
  constructor(message, { status = 0, param = null, type = null } = {}) {
    super(message);
    this.name = "ApiError";
    Object.assign(this, { status, param, type });
  }

  get unreachable() { return this.status === 0; }

  // the server's typed 404 for a session id it does not hold (deleted, expired, or lost in a restart)
  get sessionGone() { return this.status === 404 && this.param === "session_id"; }
}

export const key = {
  get: () => sessionStorage.getItem(KEY),
  set: (value) => sessionStorage.setItem(KEY, value),
  forget: () => sessionStorage.removeItem(KEY),
};

const hooks = { unauthorized() {} };
export function on(event, handler) { hooks[event] = handler; }

export async function api(path, options = {}) {
  const headers = { "content-type": "application/json", ...(options.headers || {}) };
  const held = key.get();
  if (held) headers.authorization = "Bearer " + held;
  // one signal for the user's Stop and for a server that does not begin to answer; the answer's body
  // (a long stream) may then take as long as it takes
  const controller = new AbortController();
  const late = setTimeout(() => controller.abort(), ANSWER_MS);
  if (options.signal) options.signal.addEventListener("abort", () => controller.abort(), { once: true });
  let r;
  try {
    r = await fetch(path, { ...options, headers, signal: controller.signal });
  } catch (err) {
    if (options.signal && options.signal.aborted) throw err;
    throw new ApiError(controller.signal.aborted ? "the server did not answer in time" : "the server is unreachable: it may be down or restarting");
  } finally {
    clearTimeout(late);
  }
  if (r.status === 401) {
    hooks.unauthorized(held ? "the key was not accepted" : "");
    throw new ApiError("this server needs an API key", { status: 401 });
  }
  return r;
}

export async function failure(r) {
  let body = null;
  try { body = await r.json(); } catch { /* not JSON: a proxy's error page */ }
  const e = body && body.error;
  if (e && typeof e === "object") return new ApiError(e.message, { status: r.status, param: e.param, type: e.type });
  return new ApiError(`the server answered ${r.status} ${r.statusText}`.trim(), { status: r.status });
}

export async function json(path, options) {
  const r = await api(path, options);
  if (!r.ok) throw await failure(r);
  return r.json();
}

// Reads an SSE response, calling onEvent with each JSON payload until [DONE]; an error event throws.
export async function readStream(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    let chunk;
    try {
      chunk = await reader.read();
    } catch (err) {
      if (err.name === "AbortError") throw err;
      throw new ApiError("the connection to the server was lost during the reply");
    }
    if (chunk.done) return;
    buffer += decoder.decode(chunk.value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const line = buffer.slice(0, cut).trim();
      buffer = buffer.slice(cut + 2);
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return;
      const event = JSON.parse(data);
      if (event.error) throw new ApiError(event.error.message, { status: event.error.code || 500, param: event.error.param });
      onEvent(event);
    }
  }
}
