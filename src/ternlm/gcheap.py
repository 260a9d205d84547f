"""Python's cyclic garbage collector kept off the loaded model: `freeze_loaded`.

Why: CPython's collector runs every few hundred container allocations (a decode step makes that
many: torch's tensor wrappers, the scheduler's small objects) and, in its older generations, walks
every tracked container alive: after a load, mostly the model's, the tokenizer's and the imports'
objects, which live until the process exits. perf on single-stream decode (2 threads, AVX2 Zen 3,
`--weights gguf`): `gc_collect_main` and its visits were 4.1% of all samples for smollm2-135m and
1.7% for qwen2.5-0.5b, all on the main thread, whose Python runs while the kernels' worker thread
waits; after `gc.freeze()`, 0.1% (benchmarks/RESULTS.md, "a fifth session"). vLLM and SGLang freeze
their heaps after start-up for the same reason.
"""
from __future__ import annotations

import gc
import logging

log = logging.getLogger("ternlm")


def freeze_loaded() -> int:
    """For a process that keeps its engine until it exits (the CLI's serve, generate, chat, bench):
    collects once, then moves every object alive now into the permanent generation, which the
    collector never walks (gc.freeze). Side effect, process-wide: cyclic garbage among those objects
    is never collected (objects freed by reference counting still are), so a library caller that
    loads engines and drops them should not call it. Returns the number of objects frozen."""
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    log.debug("gc: %d objects frozen after load", n)
    return n
