"""The request path, top to bottom: scheduler.py (requests -> steps, one thread owns the engine) ->
core.py (Engine: load, place a request's KV, run steps) -> sequence.py (one request: feed, sample,
verify drafts, stop) -> runner.py (one forward for many sequences) -> the model (ternlm.models).
Beside it: step_plan.py (which rows a step feeds), sampling.py (one row -> one token), detok.py
(ids -> text as it streams), fit.py (will it fit in memory), weights.py (--weights / --activations),
args.py (the engine's CLI flags -> Engine.load), spec/ (drafts the sequences verify).
May import: kv, models, linear, kernels, text, and the helpers at ternlm's top. Never server, cli, bench."""
