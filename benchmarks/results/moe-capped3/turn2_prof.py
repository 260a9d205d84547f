"""Turn 2 of the capped benchmark in-process (no cap): a 1,990-row prefill, the file's pages dropped, then
the 238-row chunk that reuses it, timed (and cProfiled unless `noprof`). Variants, as arguments:
  BYTES     the expert cache budget (default 457 MiB: `auto`'s figure under the 1.6 GiB cap before this change)
  noring    no transient ring [RING]: an expert served unkept converts into new tensors (its budget kept)
  nodirect  reads through the page cache (WILLNEED ahead, pread, DONTNEED) instead of O_DIRECT [DIRECT]
  par1      native conversion on one thread (qconvert.PARALLEL_BYTES as before: 16 MiB)
  noprof    time only

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/results/moe-capped3/turn2_prof.py [BYTES] [flags]
"""
import cProfile, io, os, pstats, sys, time
from ternlm.engine import Engine
budget = next((int(a) for a in sys.argv[1:] if a.isdigit()), 457 << 20)
M = "/tmp/m36/qwen3-30b-a3b-L4.gguf"
if "par1" in sys.argv:
    from ternlm.models import qconvert
    qconvert.PARALLEL_BYTES = 16 << 20
e = Engine.load(M, weights="gguf", expert_cache=budget, ctx=4096, chunk_size=256)
st = e.model.experts
if "noring" in sys.argv:
    st._rings = {}; st._keep = st.budget; st._share = st._keep // 4
if "nodirect" in sys.argv and st._direct is not None:
    st._direct.close(); st._direct = None
ids = [1000 + (i * 7919) % 30000 for i in range(2228)]
slot = e.slots[0]
t0 = time.perf_counter(); e.runner.prefill(slot, ids[:1990]); t1 = time.perf_counter() - t0
fd = os.open(M, os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
s0 = st.stats.as_dict()
pr = cProfile.Profile(); t0 = time.perf_counter()
if "noprof" not in sys.argv:
    pr.enable()
e.runner.prefill(slot, ids[1990:2228])
pr.disable(); dt = time.perf_counter() - t0
print(f"turn1 {t1:.2f}s; 238-row prefill {dt:.2f}s", st.stats.minus(s0), "ring", st.ring_bytes, "held", st.nbytes,
      "load", os.getloadavg())
if "noprof" not in sys.argv:
    out = io.StringIO(); pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(14); print(out.getvalue()[-3500:])
