"""`ternlm bench cluster`, tiny: a ~700-token conversation moved between two real replicas, and two
conversations of two turns on one replica and on two behind HAProxy with Redis killed for 2 s. Checks
the results JSON says what happened (prefix loaded from Redis, answers identical to cold, no failed
request, routing sticky); no timing assertions. The bench owns every process it starts (ExitStack;
PR_SET_PDEATHSIG if it is killed), so a timeout here leaves nothing running.
"""
from __future__ import annotations

import json
import subprocess
import sys


def test_tiny_run_moves_a_conversation_and_survives_redis_dying(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "ternlm.cli.main", "bench", "cluster", "--history-tokens", "700", "--repeats", "1",
           "--warmup", "0", "--conversations", "2", "--turns", "2", "--kill-after", "0.5", "--redis-down", "2",
           "--bench-gets", "50", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "cluster.json").read_text())
    m = res["moved"]
    assert m["identical"] and m["rows"][0]["redis_tokens"] >= 10 * 64
    assert m["rows"][0]["cached_tokens"] == m["rows"][0]["redis_tokens"]
    assert m["block_bytes"] > 1 << 20 and m["redis_benchmark_get_rps"] > 0
    one, two = res["replay"]["one"], res["replay"]["two"]
    assert one["failed"] == two["failed"] == 0 and one["requests"] == two["requests"] == 4
    assert res["replay"]["identical_conversations"] == 2
    assert res["replay"]["round_robin"]["failed"] == 0
    assert all(len(v) == 1 for v in two["replica_of"].values())       # each conversation on one replica
    assert two["redis_killed_at_s"] is not None
