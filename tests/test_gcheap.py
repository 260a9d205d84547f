"""gcheap.freeze_loaded: in a fresh interpreter (it is process-wide), what is alive at the call leaves
the collector's generations, and cyclic garbage made after it is still collected."""
import subprocess
import sys

CHILD = r"""
import gc, weakref
from ternlm.gcheap import freeze_loaded
keep = [{"i": i} for i in range(1000)]
n = freeze_loaded()
assert n >= 1000 and gc.get_freeze_count() == n, n
walked = {id(o) for o in gc.get_objects()}      # what the collector's generations hold
assert not any(id(o) in walked for o in keep), "frozen objects are still in the collector's generations"
class Node: pass
a, b = Node(), Node()
a.other, b.other = b, a                 # a cycle made after the freeze
gone = weakref.ref(a)
del a, b
gc.collect()
assert gone() is None, "a cycle made after the freeze was not collected"
print("ok", n)
"""


def test_freeze_loaded_in_a_fresh_process():
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ok ")
