// The chat page: conversation view, composer, sidebar of saved chats, and the reuse line per answer.
//
// Every turn sends the whole transcript (system prompt + all messages), as any OpenAI client does;
// the server reuses the KV it kept for the longest matching prefix and reports how much in
// usage.prompt_tokens_details.cached_tokens. `prompt_cache_key` = the conversation id, so the
// server routes a conversation back to the slot that holds it. Nothing here guesses reuse: the line
// under an answer shows only what the server reported (or "not reported").
// Model text reaches the DOM only through textContent / text nodes (markdown.js); never innerHTML.

import { Api, ApiError } from "./api.js";
import { renderMarkdown } from "./markdown.js";
import { TurnClock, statsDetail, statsText, turnStats } from "./stats.js";
import { Store, newId, titleOf } from "./store.js";

const $ = (id) => document.getElementById(id);
const ui = {
  shell: $("shell"), newChat: $("new-chat"), convList: $("conv-list"),
  settingsNow: $("settings-now"), maxTokens: $("set-max-tokens"), temperature: $("set-temperature"),
  forgetKey: $("forget-key"),
  server: $("server-status"), serverText: $("server-text"), toggleSidebar: $("toggle-sidebar"),
  title: $("conv-title"), model: $("model-name"), scroller: $("scroller"),
  systemPrompt: $("system-prompt"), systemPreview: $("system-preview"),
  empty: $("empty"), emptyModel: $("empty-model"), messages: $("messages"),
  banner: $("banner"), composer: $("composer"), input: $("input"), send: $("send"), stop: $("stop"),
  keyDialog: $("key-dialog"), keyForm: $("key-form"), keyMessage: $("key-message"), keyInput: $("key-input"),
};

const store = new Store();
const saved = store.loadSettings();      // what the user chose (persisted)
const settings = { ...saved };            // what this page uses: saved + URL overrides (not persisted)
const api = new Api({ askKey });
const state = {
  conv: null,        // the open conversation
  model: null,       // {id, meta} from /v1/models once the server is ready
  turn: null,        // the running turn: {controller, conv, msg, node}
  follow: true,      // keep the view at the bottom while answers grow (false once the user scrolls up)
  connecting: false, // connect() is running
};

// ---- settings (URL parameters override for this page load, e.g. ?max_tokens=24&temperature=0) ----

function applyUrlParams() {
  const q = new URLSearchParams(location.search);
  const mt = parseInt(q.get("max_tokens"), 10);
  if (mt > 0) settings.maxTokens = mt;
  const t = parseFloat(q.get("temperature"));
  if (t >= 0 && t <= 2) settings.temperature = t;
}

function setSetting(name, value) {
  settings[name] = value;
  saved[name] = value;
  store.saveSettings(saved);
}

function showSettings() {
  ui.maxTokens.value = settings.maxTokens;
  ui.temperature.value = settings.temperature;
  ui.settingsNow.textContent = `· ${settings.maxTokens} tokens · temp ${settings.temperature}`;
}

function bindSettings() {
  showSettings();
  ui.maxTokens.addEventListener("change", () => {
    const v = parseInt(ui.maxTokens.value, 10);
    if (v > 0) setSetting("maxTokens", v);
    showSettings();
  });
  ui.temperature.addEventListener("change", () => {
    const v = parseFloat(ui.temperature.value);
    if (v >= 0 && v <= 2) setSetting("temperature", v);
    showSettings();
  });
  ui.forgetKey.addEventListener("click", () => { api.key = ""; ui.forgetKey.hidden = true; });
  ui.forgetKey.hidden = !api.key;
}

// ---- API key prompt ----------------------------------------------------------------------------

function askKey(message, detail) {
  return new Promise((resolve, reject) => {
    ui.keyMessage.textContent = message;
    ui.keyInput.value = "";
    ui.keyDialog.showModal();
    ui.keyInput.focus();
    const done = (fn, v) => {
      ui.keyForm.removeEventListener("submit", onSubmit);
      ui.keyDialog.removeEventListener("cancel", onCancel);
      if (ui.keyDialog.open) ui.keyDialog.close();
      fn(v);
    };
    const onSubmit = (e) => {
      e.preventDefault();
      const key = ui.keyInput.value.trim();
      if (!key) { ui.keyInput.focus(); return; }
      ui.forgetKey.hidden = false;
      done(resolve, key);
    };
    const onCancel = (e) => {
      e.preventDefault();
      done(reject, new ApiError(401, detail || "an API key is required"));
    };
    ui.keyForm.addEventListener("submit", onSubmit);
    ui.keyDialog.addEventListener("cancel", onCancel);
  });
}

// ---- server status -----------------------------------------------------------------------------

/** Bytes as the model tooltip shows them: `28.0 KiB`. */
function kib(bytes) {
  return bytes >= 1 << 20 ? `${(bytes / (1 << 20)).toFixed(1)} MiB` : `${(bytes / 1024).toFixed(1)} KiB`;
}

function setServer(kind, text) {
  ui.server.dataset.state = kind;
  ui.serverText.textContent = text;
}

async function connect() {
  if (state.connecting) return;
  state.connecting = true;
  try {
    await connectOnce();
  } finally {
    state.connecting = false;
  }
}

/** Wait for /health, then read the model from /v1/models (this is where a key is first asked for). */
async function connectOnce() {
  setServer("loading", "connecting…");
  for (;;) {
    try {
      const h = await api.health();
      if (h.ok) break;
      if (h.status === "error") { setServer("error", "the model failed to load (click to retry)"); return; }
      setServer("loading", h.status === "stopping" ? "server is stopping" : "loading model…");
    } catch {
      setServer("error", "server unreachable");
    }
    await sleep(1000);
  }
  try {
    const body = await api.json("/v1/models");
    const card = body.data && body.data[0];
    state.model = { id: card.id, meta: card.meta || {} };
    const m = state.model.meta;
    ui.model.textContent = card.id;
    ui.model.title = [m.dtype, m.ctx && `context ${m.ctx}`, m.slots && `${m.slots} slots`,
      m.kv_dtype && `KV ${m.kv_dtype}${m.kv_bytes_per_token ? `, ${kib(m.kv_bytes_per_token)} a token` : ""}`,
      m.prefix_reuse === false ? "prefix reuse off" : "prefix reuse on"].filter(Boolean).join(" · ");
    ui.emptyModel.textContent = card.id;
    setServer("ready", `${card.id} · ready`);
    updateComposer();
  } catch (e) {
    setServer("error", `${e.message} (click to retry)`);
  }
}

// ---- conversations -----------------------------------------------------------------------------

function freshConv() {
  return { id: newId(), title: "New chat", system: settings.system || "", messages: [], created: Date.now(), updated: Date.now() };
}

function openConv(conv) {
  if (state.turn) stopTurn();
  state.conv = conv;
  store.currentId = conv.id;
  ui.systemPrompt.value = conv.system || "";
  updateSystemPreview();
  renderThread();
  renderSidebar();
  ui.shell.classList.remove("sidebar-open");
  ui.input.focus();
}

function saveConv() {
  const c = state.conv;
  c.title = titleOf(c);
  if (!store.save(c)) showBanner("Browser storage is full: this conversation is not saved.", "warn");
  renderSidebar();
}

function renderSidebar() {
  ui.convList.replaceChildren();
  const list = store.list();
  if (!list.length) {
    const p = document.createElement("p");
    p.className = "conv-none";
    p.textContent = "No saved conversations yet.";
    ui.convList.appendChild(p);
  }
  for (const c of list) {
    const row = document.createElement("div");
    row.className = "conv";
    row.dataset.id = c.id;
    if (state.conv && c.id === state.conv.id) row.setAttribute("aria-current", "true");
    const open = document.createElement("button");
    open.type = "button";
    open.className = "conv-open";
    const t = document.createElement("span");
    t.className = "conv-title";
    t.textContent = c.title || titleOf(c);
    const meta = document.createElement("span");
    meta.className = "conv-meta";
    const turns = c.messages.filter((m) => m.role === "user").length;
    meta.textContent = `${turns} turn${turns === 1 ? "" : "s"} · ${ago(c.updated)}`;
    open.append(t, meta);
    open.addEventListener("click", () => openConv(store.get(c.id)));
    const del = document.createElement("button");
    del.type = "button";
    del.className = "conv-delete";
    del.setAttribute("aria-label", "Delete conversation");
    del.title = "Delete";
    del.textContent = "×";
    del.addEventListener("click", () => {
      if (!del.classList.contains("armed")) {           // two clicks: no accidental loss, no confirm()
        del.classList.add("armed");
        del.textContent = "Delete";
        setTimeout(() => { del.classList.remove("armed"); del.textContent = "×"; }, 3000);
        return;
      }
      store.remove(c.id);
      if (state.conv && state.conv.id === c.id) openConv(freshConv());
      else renderSidebar();
    });
    row.append(open, del);
    ui.convList.appendChild(row);
  }
}

// ---- thread rendering --------------------------------------------------------------------------

function renderThread() {
  const c = state.conv;
  ui.title.textContent = titleOf(c);
  ui.messages.replaceChildren(...c.messages.map((m, i) => messageNode(m, i)));
  ui.empty.hidden = c.messages.length > 0;
  scrollToEnd();
}

function messageNode(msg, index) {
  const li = document.createElement("li");
  li.className = `msg ${msg.role}`;
  li.dataset.index = index;
  if (msg.role === "user") {
    const bubble = document.createElement("div");
    bubble.className = "bubble";
    bubble.textContent = msg.content;
    const actions = document.createElement("div");
    actions.className = "msg-actions";
    const edit = document.createElement("button");
    edit.type = "button";
    edit.className = "edit";
    edit.textContent = "Edit";
    edit.title = "Edit and resend: drops everything after this message";
    edit.addEventListener("click", () => startEdit(li, index));
    actions.appendChild(edit);
    li.append(bubble, actions);
  } else {
    const body = document.createElement("div");
    body.className = "md";
    const stats = document.createElement("div");
    stats.className = "stats";
    li.append(body, stats);
    fillAssistant(li, msg, false);
  }
  return li;
}

// A reasoning model's thinking: a collapsed, dimmed block above the answer (open while it streams).
function fillThinking(li, msg, streaming) {
  let box = li.querySelector("details.thinking");
  if (!msg.reasoning) { if (box) box.remove(); return; }
  if (!box) {
    box = document.createElement("details");
    box.className = "thinking";
    box.append(document.createElement("summary"), document.createElement("div"));
    li.querySelector(".md").before(box);
  }
  const tokens = msg.stats && msg.stats.thought ? ` (${msg.stats.thought} tokens)` : "";
  box.querySelector("summary").textContent = streaming && !msg.content ? "Thinking…" : `Thought${tokens}`;
  box.querySelector("div").textContent = msg.reasoning;
  if (streaming) box.open = !msg.content;
}

function fillAssistant(li, msg, streaming) {
  fillThinking(li, msg, streaming);
  const body = li.querySelector(".md");
  if (streaming && !msg.content && !msg.reasoning) {
    const dots = document.createElement("span");
    dots.className = "typing";
    dots.setAttribute("aria-label", "waiting for the first token");
    dots.append(document.createElement("i"), document.createElement("i"), document.createElement("i"));
    body.replaceChildren(dots);
  } else {
    body.replaceChildren(renderMarkdown(msg.content));
  }
  li.dataset.state = streaming ? "streaming" : msg.stats?.error ? "error" : msg.stats?.stopped ? "stopped" : "done";
  const stats = li.querySelector(".stats");
  stats.replaceChildren();
  if (streaming || !msg.stats) return;
  const s = msg.stats;
  stats.textContent = statsText(s);
  stats.title = statsDetail(s);
  if (s.cached != null) {
    stats.dataset.cached = s.cached;
    stats.dataset.prompt = s.prompt;
    const meter = document.createElement("span");          // the reused share of the prompt, at a glance
    meter.className = "meter";
    meter.setAttribute("aria-hidden", "true");
    const fill = document.createElement("span");
    fill.style.width = `${s.prompt ? (100 * s.cached) / s.prompt : 0}%`;   // CSSOM: allowed by the CSP
    meter.appendChild(fill);
    stats.prepend(meter);
  }
  if (s.error) {
    const retry = document.createElement("button");
    retry.type = "button";
    retry.className = "retry";
    retry.textContent = "Retry";
    retry.addEventListener("click", () => {
      const i = state.conv.messages.indexOf(msg);
      if (i >= 0 && !state.turn) { state.conv.messages.splice(i, 1); renderThread(); runTurn({}); }
    });
    stats.append(" ", retry);
  }
}

function startEdit(li, index) {
  if (state.turn || li.querySelector(".editor")) return;
  const msg = state.conv.messages[index];
  const editor = document.createElement("div");
  editor.className = "editor";
  const ta = document.createElement("textarea");
  ta.value = msg.content;
  ta.rows = Math.min(10, msg.content.split("\n").length + 1);
  const row = document.createElement("div");
  row.className = "editor-actions";
  const note = document.createElement("span");
  note.className = "editor-note";
  const after = state.conv.messages.length - index - 1;
  note.textContent = after ? `Resending drops the ${after} message${after === 1 ? "" : "s"} after this one.` : "";
  const cancel = document.createElement("button");
  cancel.type = "button";
  cancel.textContent = "Cancel";
  const send = document.createElement("button");
  send.type = "button";
  send.className = "primary";
  send.textContent = "Send";
  row.append(note, cancel, send);
  editor.append(ta, row);
  li.classList.add("editing");
  li.append(editor);
  ta.focus();
  ta.setSelectionRange(ta.value.length, ta.value.length);
  const close = () => { editor.remove(); li.classList.remove("editing"); };
  const submit = () => {
    const text = ta.value.trim();
    if (!text || state.turn || !state.model) return;
    close();
    state.conv.messages = state.conv.messages.slice(0, index);   // truncate after the edited message
    state.conv.messages.push({ role: "user", content: text, edited: true });
    saveConv();
    renderThread();
    runTurn({ edited: true });
  };
  cancel.addEventListener("click", close);
  send.addEventListener("click", submit);
  ta.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); submit(); }
    if (e.key === "Escape") { e.preventDefault(); close(); }
  });
}

// ---- a turn ------------------------------------------------------------------------------------

function transcript(conv, upTo) {
  const out = [];
  if (conv.system && conv.system.trim()) out.push({ role: "system", content: conv.system });
  for (const m of conv.messages.slice(0, upTo)) {
    if (m.role === "assistant" && m.stats?.error && !m.content) continue;   // a failed turn sent nothing
    out.push({ role: m.role, content: m.content });
  }
  return out;
}

async function runTurn({ edited = false }) {
  const conv = state.conv;
  const msg = { role: "assistant", content: "", stats: null };
  conv.messages.push(msg);
  const node = messageNode(msg, conv.messages.length - 1);
  ui.messages.appendChild(node);
  ui.empty.hidden = true;
  fillAssistant(node, msg, true);
  scrollToEnd();

  const controller = new AbortController();
  state.turn = { controller, conv, msg, node };
  updateComposer();
  hideBanner();

  const body = {
    model: state.model.id, messages: transcript(conv, conv.messages.length - 1), stream: true,
    stream_options: { include_usage: true }, max_tokens: settings.maxTokens,
    temperature: settings.temperature, prompt_cache_key: conv.id,
  };
  let pending = false;
  const paint = () => {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      if (state.turn && state.turn.msg === msg) {
        fillAssistant(node, msg, true);
        follow();
      }
    });
  };
  const clock = new TurnClock();
  let usage = null, timings = null, finish = null, outcome = {};
  try {
    for await (const chunk of api.chat(body, controller.signal)) {
      const choice = chunk.choices && chunk.choices[0];
      const text = choice && choice.delta && choice.delta.content;
      const thought = choice && choice.delta && choice.delta.reasoning_content;
      if (thought) {           // kept apart; never resent (templates drop old thinking)
        clock.delta();
        msg.reasoning = (msg.reasoning || "") + thought;
        paint();
      }
      if (text) {
        clock.delta();
        msg.content += text;
        paint();
      }
      if (choice && choice.finish_reason) finish = choice.finish_reason;
      if (chunk.timings) timings = chunk.timings;
      if (chunk.usage) usage = chunk.usage;
    }
  } catch (e) {
    if (e.name === "AbortError") outcome = { stopped: true };
    else outcome = { error: e instanceof ApiError ? e.message : `cannot reach the server (${e.message})` };
  }
  msg.stats = turnStats({ usage, timings, finish, clock, edited, ...outcome });

  if (state.turn && state.turn.msg === msg) state.turn = null;
  updateComposer();
  if (state.conv === conv) {
    fillAssistant(node, msg, false);
    follow();
  }
  if (conv === state.conv) saveConv();
  else { conv.title = titleOf(conv); store.save(conv); renderSidebar(); }   // the user switched away mid-turn
}

function stopTurn() {
  if (state.turn) state.turn.controller.abort();
}

// ---- composer ----------------------------------------------------------------------------------

function updateComposer() {
  const busy = !!state.turn;
  ui.send.hidden = busy;
  ui.stop.hidden = !busy;
  ui.send.disabled = !state.model;
  ui.composer.classList.toggle("busy", busy);
}

function submit() {
  const text = ui.input.value.trim();
  if (!text || state.turn) return;
  if (!state.model) { showBanner("The model is not ready yet; your message is still here.", "warn"); return; }
  ui.input.value = "";
  autoGrow();
  state.conv.messages.push({ role: "user", content: text });
  saveConv();
  renderThread();
  runTurn({});
}

function autoGrow() {
  ui.input.style.height = "auto";
  ui.input.style.height = Math.min(ui.input.scrollHeight, 240) + "px";
}

function showBanner(text, kind = "error") {
  ui.banner.textContent = text;
  ui.banner.dataset.kind = kind;
  ui.banner.hidden = false;
}

function hideBanner() {
  ui.banner.hidden = true;
}

function updateSystemPreview() {
  const s = (state.conv.system || "").replace(/\s+/g, " ").trim();
  ui.systemPreview.textContent = s ? `· ${s.length > 50 ? s.slice(0, 47) + "…" : s}` : "· none";
}

// ---- helpers -----------------------------------------------------------------------------------

function nearEnd() {
  const s = ui.scroller;
  return s.scrollHeight - s.scrollTop - s.clientHeight < 120;
}

function scrollToEnd() {
  state.follow = true;
  ui.scroller.scrollTop = ui.scroller.scrollHeight;
}

function follow() {
  if (state.follow) ui.scroller.scrollTop = ui.scroller.scrollHeight;
}

function sleep(ms) {
  return new Promise((r) => setTimeout(r, ms));
}

function ago(t) {
  const s = (Date.now() - (t || 0)) / 1000;
  if (s < 60) return "just now";
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ago`;
  if (s < 7 * 86400) return `${Math.floor(s / 86400)} d ago`;
  return new Date(t).toLocaleDateString();
}

// ---- wiring ------------------------------------------------------------------------------------

function init() {
  applyUrlParams();
  bindSettings();
  ui.composer.addEventListener("submit", (e) => { e.preventDefault(); submit(); });
  ui.input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); submit(); }
  });
  ui.input.addEventListener("input", autoGrow);
  ui.scroller.addEventListener("scroll", () => { state.follow = nearEnd(); }, { passive: true });
  ui.stop.addEventListener("click", stopTurn);
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && state.turn && !ui.keyDialog.open) stopTurn();
  });
  ui.newChat.addEventListener("click", () => openConv(freshConv()));
  ui.server.addEventListener("click", () => { if (!state.model) connect(); });
  window.addEventListener("storage", (e) => {
    if (e.key === null || e.key === "ternlm.chats.v1") { store.reload(state.conv.id); renderSidebar(); }
  });
  ui.toggleSidebar.addEventListener("click", (e) => { e.stopPropagation(); ui.shell.classList.toggle("sidebar-open"); });
  document.querySelector(".main").addEventListener("click", () => ui.shell.classList.remove("sidebar-open"));
  ui.systemPrompt.addEventListener("input", () => {
    state.conv.system = ui.systemPrompt.value;
    setSetting("system", ui.systemPrompt.value);   // new chats start with the last system prompt used
    updateSystemPreview();
    if (state.conv.messages.length) saveConv();
  });
  const saved = store.currentId && store.get(store.currentId);
  openConv(saved || freshConv());
  updateComposer();
  connect();
}

init();
