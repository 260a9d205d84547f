// Talking to the server: JSON calls and the chat SSE stream, with the API key when one is needed.
//
// The key: on a 401 the caller's `askKey(message)` is awaited (one prompt at a time, shared by all
// requests waiting on it) and the request is retried with `Authorization: Bearer <key>`. The key lives
// in sessionStorage: this tab only, gone when it closes; it is never written to localStorage.

const KEY_STORE = "ternlm.apiKey";

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.code = code || null;
  }
}

export class Api {
  /** askKey(message) -> Promise<string>: show the prompt; reject if the user gives up. */
  constructor({ askKey }) {
    this.askKey = askKey;
    this._asking = null;       // the open key prompt, shared by every request waiting on it
    this._memKey = "";         // fallback when sessionStorage is unavailable
  }

  get key() {
    try { return sessionStorage.getItem(KEY_STORE) || ""; } catch { return ""; }
  }

  set key(value) {
    try {
      if (value) sessionStorage.setItem(KEY_STORE, value);
      else sessionStorage.removeItem(KEY_STORE);
    } catch { /* storage disabled: the key lasts as long as this page */ }
    this._memKey = value;
  }

  _currentKey() {
    return this.key || this._memKey || "";
  }

  /** fetch with auth; on 401 asks for a key and retries. Resolves with an ok Response or throws ApiError. */
  async fetch(path, init = {}) {
    for (;;) {
      const headers = new Headers(init.headers || {});
      const key = this._currentKey();
      if (key) headers.set("Authorization", `Bearer ${key}`);
      const res = await fetch(path, { ...init, headers });
      if (res.status === 401) {
        const err = await errorOf(res);
        const message = key ? "That key was not accepted. Enter a valid API key." : "This server requires an API key.";
        if (!this._asking) {
          this._asking = this.askKey(message, err.message).finally(() => { this._asking = null; });
        }
        this.key = await this._asking;      // rejects if the user cancels: the request fails
        continue;
      }
      if (!res.ok) throw await errorOf(res);
      return res;
    }
  }

  async json(path, init) {
    return (await this.fetch(path, init)).json();
  }

  /** GET /health without auth: {status, ok}. Never throws for HTTP statuses. */
  async health() {
    const res = await fetch("/health", { cache: "no-store" });
    let body = {};
    try { body = await res.json(); } catch { /* not JSON */ }
    return { ok: res.ok, status: body.status || String(res.status), error: body.error || null };
  }

  /** Stream a chat completion: yields each SSE JSON object until [DONE]. Throws ApiError on an
   *  HTTP error or an `error` event; an abort surfaces as the fetch's AbortError. */
  async *chat(body, signal) {
    const res = await this.fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
      body: JSON.stringify(body),
      signal,
    });
    for await (const obj of sseEvents(res.body, signal)) {
      if (obj.error) throw new ApiError(500, obj.error.message || "generation failed", obj.error.code);
      yield obj;
    }
  }
}

async function errorOf(res) {
  let message = `HTTP ${res.status}`;
  let code = null;
  try {
    const body = await res.json();
    if (body && body.error) {
      message = body.error.message || message;
      code = body.error.code || null;
    }
  } catch { /* not JSON */ }
  return new ApiError(res.status, message, code);
}

/** Parse a text/event-stream body into the JSON objects of its `data:` lines. */
async function* sseEvents(stream, signal) {
  const reader = stream.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
    if (signal && signal.aborted) throw new DOMException("aborted", "AbortError");
    throw new ApiError(0, "the connection closed before the answer finished");
  } finally {
    reader.cancel().catch(() => {});
  }
}
