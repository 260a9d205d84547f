"""Benchmarks: side by side in one run, medians and ratios, reuse fraction beside every speedup."""
