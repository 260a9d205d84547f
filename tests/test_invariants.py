"""Invariants fail the request, not the server, and they stay on under `python -O`: the engine's checks
are explicit (ternlm/invariants.py), never `assert` statements, which -O strips."""
from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "ternlm"


def test_no_assert_statements_in_the_package():
    found = [f"{path.relative_to(SRC)}:{node.lineno}"
             for path in sorted(SRC.rglob("*.py"))
             for node in ast.walk(ast.parse(path.read_text(), str(path))) if isinstance(node, ast.Assert)]
    assert found == [], f"use ternlm.invariants.check, not assert (stripped by python -O): {found}"


CHILD = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    assert False, "this line must be stripped by -O"
    from tiny import tiny_engine
    from ternlm.invariants import InvariantError
    from ternlm.kv.blockfile import BlockKV
    from ternlm.kv.record import PrefixRecord
    _, engine = tiny_engine("llama", seed=1, dtype="float32")
    slot = engine.slots[0]
    slot.reset(b"ns")
    shape = (slot.shape.layers + 1, slot.shape.kv_heads, 64, slot.shape.row)          # one layer too many
    class Meta: pass
    meta = Meta(); meta.shape = shape; meta.ids = tuple(range(64)); meta.state = None
    block = BlockKV(meta, torch.zeros(shape), torch.zeros(shape))
    try:
        engine.runner.load_blocks(slot, [block])
        print("loaded a foreign-shaped block")
    except InvariantError as e:
        print("refused:", e, "| record", len(slot.record))
    rec = PrefixRecord()
    try:
        rec.append([1, 2, 3], digests={{7: b"x"}})
        print("recorded a digest outside its range")
    except InvariantError as e:
        print("refused:", e, "| record", len(rec.fed))
    out = engine.generate([1, 2, 3, 4, 5], max_tokens=3)           # the engine carries on
    print("generated", len(out.token_ids))
""")


def test_checks_hold_under_python_O():
    tests = str(Path(__file__).resolve().parent)
    r = subprocess.run([sys.executable, "-O", "-c", CHILD.format(tests=tests)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("refused: a stored block of shape") and lines[0].endswith("| record 0")
    assert lines[1] == "refused: digest position outside the appended range | record 0"
    assert lines[2] == "generated 3"
