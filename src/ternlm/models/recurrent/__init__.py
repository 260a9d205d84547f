"""The recurrent mixers of hybrid models: deltanet.py (Qwen3.5 / Qwen3-Next gated DeltaNet), mamba2.py
(Nemotron-H), shortconv.py (LFM2); conv_state.py, the short causal conv window and state write they share.
Their state lives in kv/recurrent.py's slots.
May import: kernels, models' own helpers, invariants."""
