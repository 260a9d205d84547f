// The line under each answer: `reused 2034 / 2065 tokens · first token 0.07 s · 48 tok/s`.
//
// Reuse comes only from the server (usage.prompt_tokens_details.cached_tokens of usage.prompt_tokens);
// the page never estimates it. Time to first token and speed come from the server's llama.cpp-style
// `timings` (prompt_ms = prefill time, predicted_per_second) when it sends them, else from this
// browser's clock, and the tooltip says which. A stopped stream has no usage chunk: "stopped · ...".

/** Client-side timing of one streamed answer. Started when the request is sent. */
export class TurnClock {
  constructor() {
    this.t0 = performance.now();
    this.first = null;     // ms: the first non-empty delta
    this.last = null;
    this.deltas = 0;
  }

  delta() {
    const now = performance.now();
    if (this.first === null) this.first = now;
    this.last = now;
    this.deltas++;
  }

  /** Seconds from sending to the first text, or null. */
  get firstS() {
    return this.first === null ? null : (this.first - this.t0) / 1000;
  }

  /** Deltas per second after the first (about tokens/s: the server sends one delta per token). */
  get rate() {
    return this.deltas > 1 && this.last > this.first ? (this.deltas - 1) / ((this.last - this.first) / 1000) : null;
  }
}

/** The numbers kept with an answer (and saved with the conversation). */
export function turnStats({ usage, timings, finish, clock, edited, stopped, error }) {
  const s = {};
  if (error) s.error = error;
  if (stopped) s.stopped = true;
  if (usage) {
    s.prompt = usage.prompt_tokens;
    const cached = usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens;
    if (cached != null) s.cached = cached;
    s.completion = usage.completion_tokens;
    const thought = usage.completion_tokens_details && usage.completion_tokens_details.reasoning_tokens;
    if (thought) s.thought = thought;
  }
  if (clock.firstS !== null) s.clientFirstS = clock.firstS;
  if (timings && timings.prompt_ms != null) {
    s.prefillMs = timings.prompt_ms;
    s.firstTokenS = timings.prompt_ms / 1000;
    s.tokPerS = timings.predicted_per_second || null;
    if (timings.cache_tier === "ram" || timings.cache_tier === "disk") s.tier = timings.cache_tier;
    if (timings.draft_n) { s.drafted = timings.draft_n; s.accepted = timings.draft_n_accepted || 0; }
  } else {
    s.measured = clock.firstS !== null;
    s.firstTokenS = clock.firstS;
    s.tokPerS = clock.rate;
  }
  if (finish) s.finish = finish;
  if (edited) s.edited = true;
  return s;
}

/** `reused 2034 / 2065 tokens · first token 0.07 s · 48 tok/s` (+ stopped / max tokens / edit notes). */
export function statsText(s) {
  const parts = [];
  if (s.error) parts.push(`error: ${s.error}`);
  if (s.stopped) parts.push("stopped");
  if (s.cached != null) parts.push(`reused ${s.cached} / ${s.prompt} tokens${s.tier ? ` from ${s.tier}` : ""}`);
  else if (!s.error && !s.stopped) parts.push("reuse not reported");   // a stopped stream has no usage chunk
  if (s.firstTokenS != null) parts.push(`first token ${s.firstTokenS.toFixed(2)} s`);
  if (s.tokPerS) parts.push(`${s.tokPerS >= 10 ? Math.round(s.tokPerS) : s.tokPerS.toFixed(1)} tok/s`);
  if (s.thought) parts.push(`thought ${s.thought} tok`);
  if (s.drafted) parts.push(`drafts ${s.accepted} / ${s.drafted} taken`);
  if (s.finish === "length") parts.push("hit max tokens");
  if (s.edited) parts.push("resent after an edit");
  return parts.join(" · ");
}

/** The tooltip: where each number came from. */
export function statsDetail(s) {
  const lines = [];
  if (s.cached != null) lines.push(`${s.cached} prompt tokens reused from the server's KV cache` +
    `${s.tier ? ` (loaded from its ${s.tier === "ram" ? "RAM" : "disk"} tier)` : ""}, ${s.prompt - s.cached} prefilled`);
  if (s.prefillMs != null) lines.push(`prefill ${s.prefillMs.toFixed(0)} ms (server)`);
  if (s.clientFirstS != null) lines.push(`first token after ${s.clientFirstS.toFixed(2)} s (measured here)`);
  if (s.completion != null) lines.push(`${s.completion} tokens generated`);
  if (s.drafted) lines.push(`speculative decoding: ${s.accepted} of ${s.drafted} drafted tokens were the model's own ` +
    `(${Math.round(100 * s.accepted / s.drafted)}%); the answer is the same without it`);
  if (s.measured) lines.push("timings measured in the browser (the server sent none)");
  return lines.join("\n");
}
