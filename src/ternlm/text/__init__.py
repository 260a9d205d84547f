"""Text in and out of the model, no tensors: tokenizer.py (GGUF/HF vocabularies), chat.py (chat templates),
message_marks.py (where each message starts in a rendered prompt), grammar.py (JSON schema / regex ->
a token mask), tools.py and reasoning.py (tool calls and thinking parsed out of answers).
May import: invariants only."""
