"""Native kernels built for the host CPU at run time (build.py), each with a pure-torch fallback."""
