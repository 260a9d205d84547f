"""Speculation: guesses of the next tokens that the engine verifies in one forward (never changing an answer).
drafter.py (the protocol a drafter implements + prompt lookup, the default), draft_model.py (a small
model's greedy guesses, its own Engine and KV), draft_batch.py (all live draft lanes in one forward).
Inside engine/ because it is both sides of the request path: sequences ask drafters, and the draft
model runs through the engine's own Runner and restore record. May import: ternlm.engine's runner and
sequence, kv, invariants."""
