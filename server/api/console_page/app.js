// kvserve's console: a chat and completion playground, and a live view of sessions and the KV pool. Plain
// ES modules, no build step: this one starts the page, asks for a key where the server needs one, and
// switches the tabs; each other module is one concept (api, connection, settings, sessions, chat,
// completion, live).
import { key, on } from "./api.js";
import * as connection from "./connection.js";
import "./chat.js";
import "./completion.js";
import * as live from "./live.js";
import * as sessions from "./sessions.js";
import * as settings from "./settings.js";

const $ = (sel) => document.querySelector(sel);
const PHONE = window.matchMedia("(max-width: 720px)");
let shown = false;

function lockTabs(locked) {
  document.querySelectorAll(".tab").forEach((tab) => { tab.disabled = locked; });
}

function showKeyForm(error) {
  connection.stop("key");
  shown = false;
  lockTabs(true);
  $("#app").hidden = true;
  $("#key-form").hidden = false;
  $("#key-error").textContent = error || "";
  $("#key-input").focus();
}

function onStatus(status) {
  if (!shown) {
    shown = true;
    $("#key-form").hidden = true;
    $("#app").hidden = false;
    $("#forget-key").hidden = !key.get();
    $("#model").textContent = status.model;
    settings.applyLimits(status);
    lockTabs(false);
  }
  live.render(status);
  sessions.update(status);
}

on("unauthorized", showKeyForm);

$("#key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const value = $("#key-input").value.trim();
  if (!value) { $("#key-error").textContent = "Enter the API key this server was started with (--api-key)."; return; }
  key.set(value);
  $("#key-error").textContent = "";
  connection.start(onStatus);
});
$("#forget-key").addEventListener("click", () => { key.forget(); location.reload(); });

document.querySelectorAll(".tab").forEach((tab) => tab.addEventListener("click", () => {
  document.querySelectorAll(".tab").forEach((t) => t.classList.toggle("active", t === tab));
  document.querySelectorAll(".view").forEach((v) => { v.hidden = v.id !== tab.dataset.tab; });
  $("#settings").hidden = tab.dataset.tab === "live";
  $("#app").classList.toggle("wide", tab.dataset.tab === "live");
}));

// On a phone the settings go under the views, in the page's order and not only as drawn, so Tab reaches
// the message box first; beside them on a wider screen, they come first.
function placeSettings() {
  if (PHONE.matches) $("#app").append($("#settings"));
  else $("#app").prepend($("#settings"));
}

PHONE.addEventListener("change", placeSettings);
placeSettings();
// on a phone the settings start folded, so the message box is on the first screen
if (PHONE.matches) $("#settings").open = false;
connection.start(onStatus);
