"""Benchmarks: side by side in one run, medians and ratios, reuse fraction beside every speedup.
`ternlm bench <part>` (cli.py), report.py (make bench), llamacpp.py (the one place llama.cpp's binaries
are found and started), procs.py (free port, readiness wait, the `ternlm serve` launcher).
May import anything in ternlm; only cli imports it."""
