"""The token a chat template opens every message with (ChatML's `<|im_start|>`, Llama 3's
`<|start_header_id|>`, Gemma's `<start_of_turn>`), found by rendering a probe conversation.

Why: a hybrid model's slot snapshots its recurrent state where the fed token is such a mark
(kv/recurrent.py `wants`), i.e. at every message start. An edit of an earlier message diverges right
after its start, and a state cannot be cut back: without a snapshot there, reuse resumes at the grid
point before it, or further back once the snapshots past an earlier edit were dropped.

Found, not configured: the template is the model's (or --chat-template's), and a wrong mark costs only
snapshots, never bits (a snapshot at any position is exact). A template whose messages do not all
start with one special token gets no mark (an empty set): grid and prefill ends only.
"""
from __future__ import annotations

from .chat import ChatTemplateError, message_boundaries, render_chat

# Probe conversations, tried in order until one renders (some templates insist on a system message first,
# or on user/assistant alternation); distinct short contents so no two messages tokenize alike.
_PROBES = (
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
     {"role": "user", "content": "three"}],
    [{"role": "system", "content": "zero"}, {"role": "user", "content": "one"},
     {"role": "assistant", "content": "two"}, {"role": "user", "content": "three"}],
)


def message_marks(template: str | None, tokenizer) -> frozenset[int]:
    """The ids of the special token that starts every message after the first in a probe rendering of
    `template` (at most one id), or an empty set: no template, no probe renders, or the messages do not
    all start with the same special token. Pure (renders and tokenizes only)."""
    if not template:
        return frozenset()
    kw = dict(bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    for messages in _PROBES:
        try:
            text = render_chat(template, messages, add_generation_prompt=False, **kw)
            ends = message_boundaries(template, messages, add_generation_prompt=False, **kw)
        except ChatTemplateError:
            continue
        return _mark_at(text, ends[:-1], tokenizer)
    return frozenset()


def _mark_at(text: str, starts: list[int | None], tokenizer) -> frozenset[int]:
    """{t} when the token at every character offset in `starts` (a message's start: where the messages
    before it end) is the same special token t written there (not an unknown token standing for other
    text), and the text tokenizes the same with or without what follows each offset (else the token
    there is not the message's own). Pure."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    found = set()
    for c in starts:
        if c is None:
            return frozenset()
        head = tokenizer.encode(text[:c], add_special_tokens=False)
        if ids[:len(head)] != head or len(head) >= len(ids):
            return frozenset()
        t = ids[len(head)]
        if not tokenizer.is_special(t) or not text.startswith(tokenizer.id_to_token(t) or "\0", c):
            return frozenset()
        found.add(t)
    return frozenset(found) if len(found) == 1 else frozenset()
