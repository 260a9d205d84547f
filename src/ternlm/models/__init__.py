"""Models: files -> tensors -> the network. registry.py (named models, downloads verified by sha256),
gguf.py / hf.py (loaders), families.py (each architecture's file conventions as one table entry: how the
loaders read it), config.py (one validated dataclass of hyper-parameters per model: the layers' kinds as
fields), templates.py (chat templates a file lacks), llama.py (the transformer every family runs:
attention, MLP or moe.py's experts, recurrent/ mixers for hybrids, lfm2.py and nemotron_h.py their layer
layouts), native_layer.py / native_moe.py (a whole layer in one C call), rope.py, loaded.py (what a
loader hands the engine), param_check.py.
May import: kernels, linear, text, kv, and the helpers at ternlm's top. Never engine, server, cli, bench."""
