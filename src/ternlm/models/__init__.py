"""Model files -> tensors (gguf.py, hf.py), named models (registry.py), the network (llama.py)."""
