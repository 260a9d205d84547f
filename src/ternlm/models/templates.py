"""Built-in chat templates for files that carry none, chosen by architecture.

Gemma 3 GGUFs of the base models (gemma-3-270m) have no `tokenizer.chat_template`; Gemma's turn format
is fixed by the family, so the loaders fall back to it (logged once per process) rather than leaving
the model without chat. `--chat-template FILE` still overrides whatever is chosen here.
"""
from __future__ import annotations

import logging

log = logging.getLogger("ternlm")

# Gemma's turn format: a system message is folded into the first user turn, as Google's template does.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for part in message['content'] -%}{%- if part['type'] == 'text' -%}"
    "{{ part['text'] | trim }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

BUILTIN_TEMPLATES = {"gemma3": ("gemma", GEMMA_TEMPLATE)}
_logged: set[str] = set()


def with_builtin_template(arch: str, template: str | None) -> str | None:
    """The file's template when it has one, else the architecture's built-in one (None if there is
    none). Side effect: the first fallback per architecture in this process is logged."""
    if template or arch not in BUILTIN_TEMPLATES:
        return template
    name, builtin = BUILTIN_TEMPLATES[arch]
    if arch not in _logged:
        _logged.add(arch)
        log.info("no chat template in the file; using the built-in %s template", name)
    return builtin
