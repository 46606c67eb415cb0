// The sampling settings, checked in the page before anything is sent: an empty field leaves the choice to
// the server, and a value out of range is refused beside its field, with the range it must be in.
const $ = (sel) => document.querySelector(sel);

const NUMBERS = [
  { id: "temperature", param: "temperature", name: "Temperature", min: 0, max: 2 },
  { id: "top-p", param: "top_p", name: "Top-p", min: 0, above: true, max: 1 },
  { id: "max-tokens", param: "max_tokens", name: "Max tokens", min: 1, max: 4096, whole: true },
  { id: "seed", param: "seed", name: "Seed", min: 0, max: Number.MAX_SAFE_INTEGER, whole: true },
];

export class SettingsError extends Error {
  constructor(id, message) { super(message); this.id = id; }
}

// The server's context bounds max_tokens: a reply can never be longer.
export function applyLimits(status) {
  const field = NUMBERS.find((f) => f.id === "max-tokens");
  field.max = status.max_context;
  $("#max-tokens").max = String(status.max_context);
}

function number(field) {
  const input = $("#" + field.id);
  const raw = input.value.trim();
  if (input.validity.badInput) throw new SettingsError(field.id, `${field.name} must be a number`);
  if (raw === "") return undefined;
  const value = Number(raw);
  const range = `${field.above ? "above" : "from"} ${field.min} ${field.above ? "and at most" : "to"} ${field.max}`;
  if (!Number.isFinite(value) || (field.whole && !Number.isInteger(value))
      || value < field.min || (field.above && value === field.min) || value > field.max) {
    throw new SettingsError(field.id, `${field.name} must be ${field.whole ? "a whole number " : ""}${range}`);
  }
  return value;
}

function extra() {
  const raw = $("#extra").value.trim();
  if (!raw) return {};
  let parsed;
  try { parsed = JSON.parse(raw); } catch (err) { throw new SettingsError("extra", "Extra request fields are not valid JSON: " + err.message); }
  if (parsed === null || typeof parsed !== "object" || Array.isArray(parsed)) {
    throw new SettingsError("extra", 'Extra request fields must be a JSON object, such as {"stop": ["\\n"]}');
  }
  return parsed;
}

// The request's sampling fields, or a SettingsError for the first field that is wrong.
export function read() {
  clear();
  const body = { stream: true, stream_options: { include_usage: true } };
  for (const field of NUMBERS) {
    const value = number(field);
    if (value !== undefined) body[field.param] = value;
  }
  return { ...body, ...extra() };
}

export function show(err) {
  const input = $("#" + err.id);
  input.setAttribute("aria-invalid", "true");
  const note = document.createElement("small");
  note.className = "error field-error";
  note.textContent = err.message;
  input.insertAdjacentElement("afterend", note);
  $("#settings").open = true;  // folded away on a phone: the message must be seen
  input.focus({ preventScroll: true });
  // the field and its message, whole, on the screen: focus alone would show the field and leave the
  // message below it, out of sight on a phone
  input.closest("label").scrollIntoView({ block: "nearest" });
}

function clear() {
  document.querySelectorAll(".field-error").forEach((n) => n.remove());
  document.querySelectorAll("[aria-invalid]").forEach((n) => n.removeAttribute("aria-invalid"));
}

document.querySelectorAll("#settings input, #settings textarea").forEach((input) => input.addEventListener("input", clear));
