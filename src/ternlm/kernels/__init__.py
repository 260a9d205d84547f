"""Native kernels built for the host CPU at run time (build.py compiles the C sources beside it once per
CPU kind and source digest; layouts.h lists the weight layouts), each with a pure-torch fallback.
May import: kv (the disk tier's secure directory for the build cache) and the helpers at ternlm's top."""
