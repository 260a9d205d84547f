// Conversations and settings in localStorage.
//
// A conversation: {id, title, system, messages: [{role, content, stats?, edited?}], created, updated}.
// All conversations live under one key so a write is one setItem; a full or disabled storage
// degrades to "this page only" (the caller is told, nothing throws).

const CHATS = "ternlm.chats.v1";
const CURRENT = "ternlm.current";
const SETTINGS = "ternlm.settings.v1";
export const DEFAULT_SETTINGS = { maxTokens: 256, temperature: 0.7, system: "" };

function read(key, fallback) {
  try {
    const raw = localStorage.getItem(key);
    return raw ? JSON.parse(raw) : fallback;
  } catch {
    return fallback;
  }
}

function write(key, value) {
  try {
    localStorage.setItem(key, JSON.stringify(value));
    return true;
  } catch {
    return false;    // quota exceeded or storage disabled
  }
}

export function newId() {
  const b = crypto.getRandomValues(new Uint8Array(9));
  return "c" + Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
}

function readChats() {
  const all = read(CHATS, {});
  return all && typeof all === "object" && !Array.isArray(all) ? all : {};
}

export class Store {
  constructor() {
    this.chats = readChats();
  }

  /** Take in what other tabs wrote (on the window's "storage" event); `keepId`, the chat open here, stays as is. */
  reload(keepId) {
    const fresh = readChats();
    for (const id of Object.keys(this.chats)) if (!(id in fresh) && id !== keepId) delete this.chats[id];
    for (const [id, c] of Object.entries(fresh)) if (id !== keepId) this.chats[id] = c;
  }

  /** Conversations with at least one message, most recently updated first. */
  list() {
    return Object.values(this.chats).filter((c) => c.messages && c.messages.length)
      .sort((a, b) => (b.updated || 0) - (a.updated || 0));
  }

  get(id) {
    return this.chats[id] || null;
  }

  // Each write re-reads storage and changes only its own conversation, so two open tabs never
  // erase each other's chats.

  /** Save `conv` (stamps `updated`). Returns false if storage refused it. */
  save(conv) {
    conv.updated = Date.now();
    this.chats[conv.id] = conv;
    if (!conv.messages.length) return true;          // an empty chat is not worth a list entry yet
    const all = readChats();
    all[conv.id] = conv;
    return write(CHATS, all);
  }

  remove(id) {
    delete this.chats[id];
    const all = readChats();
    delete all[id];
    write(CHATS, all);
  }

  get currentId() {
    try { return localStorage.getItem(CURRENT); } catch { return null; }
  }

  set currentId(id) {
    try { localStorage.setItem(CURRENT, id); } catch { /* ignore */ }
  }

  loadSettings() {
    return { ...DEFAULT_SETTINGS, ...read(SETTINGS, {}) };
  }

  saveSettings(s) {
    write(SETTINGS, s);
  }
}

/** A conversation's title: its first user message, shortened. */
export function titleOf(conv) {
  const first = conv.messages.find((m) => m.role === "user");
  const text = first ? first.content.replace(/\s+/g, " ").trim() : "";
  return text ? (text.length > 60 ? text.slice(0, 57) + "…" : text) : "New chat";
}
