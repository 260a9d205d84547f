"""`ternlm bench tiers`, tiny: smollm2-135m float32, a ~520-token conversation, one round, no warm-up.

One run checks the whole path: every case restores from the tier it is named after (slot, RAM, disk
with the page cache dropped and warm, Redis where /usr/bin/redis-server exists, nothing), the results
JSON says so, each tier's bytes a token is what it holds (K+V a token exactly in the slot and RAM, plus
headers on disk and in Redis), the temporary disk tier and the bench's own redis-server are gone, and
the identity check fails the run when one case's logits differ by one ulp-sized nudge (injected into
disk-warm only: the other cases must still be bit-identical to the cold prefill). No timing assertions.
Without a redis-server binary --redis auto skips the case and says why (no model needed to check).
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from ternlm.bench import tiers
from ternlm.kv.blocks import BLOCK_TOKENS
from ternlm.cli.main import main


def test_tiny_run_restores_from_each_tier_and_the_identity_check_bites(tmp_path, monkeypatch):
    real = tiers.run_case

    def nudged(engine, case, *a):
        sample, logits = real(engine, case, *a)
        if case == "disk-warm":
            logits = logits.clone()
            logits[0, 0] += 1e-3          # not the argmax: the first token stays the same
        return sample, logits

    monkeypatch.setattr(tiers, "run_case", nudged)
    out = tmp_path / "out"
    argv = ["bench", "tiers", "-m", "smollm2-135m", "--dtype", "float32", "--threads", "1",
            "--history-tokens", "520", "--ctx", "1024", "--repeats", "1", "--warmup", "0", "--seq-mib", "4",
            "--cache-dir", str(tmp_path), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["ternlm", *argv])   # what the results record as the command
    rc = main(argv)
    assert rc == 1                                        # the nudged case fails the run

    res = json.loads((out / "tiers-smollm2-135m.json").read_text())
    assert res["command"] == "ternlm " + " ".join(argv)
    assert res["tiers_ok"] is True and res["wrong_tier"] == []
    assert res["identical"] is False and res["same_first_token"] is True
    assert res["mismatches"] and all("disk-warm" in m for m in res["mismatches"])
    cases = res["cases"]
    has_redis = os.access(tiers.REDIS_SERVER, os.X_OK)
    assert list(cases) == ["slot", "ram", "disk-cold", "disk-warm", *(["redis"] if has_redis else []), "none"]
    assert (res["redis"]["skipped"] is None) is has_redis
    for case, c in cases.items():
        assert c["identical_logits"] is (case != "disk-warm"), case
        assert c["tier"] == tiers.EXPECT_TIER[case]
        assert c["cached_tokens"] + c["prefill_tokens"] == res["next_turn_tokens"]
        assert abs(c["reuse_fraction"] - c["cached_tokens"] / res["next_turn_tokens"]) < 1e-12
    assert cases["none"]["cached_tokens"] == 0
    assert cases["slot"]["tokens_by_tier"]["slot"] > res["previous_turn_tokens"]  # prev + the answer
    slot = cases["slot"]["cached_tokens"]
    for case in ("ram", "disk-cold", "disk-warm"):      # whole blocks + the tail entry: as a slot hit
        by = cases[case]["tokens_by_tier"]
        assert by[tiers.EXPECT_TIER[case]] == cases[case]["cached_tokens"] == slot
        assert cases[case]["prefill_tokens"] == cases["slot"]["prefill_tokens"]
    entries = -(-slot // BLOCK_TOKENS)                   # whole blocks, and the tail
    assert slot % BLOCK_TOKENS, "the conversation should end inside a block (else no tail is read)"
    for case in ("disk-cold", "disk-warm"):              # the record ends where the next turn diverges
        headers = cases[case]["disk_bytes_read"] - slot * res["kv_bytes_per_token"]   # payload + headers
        assert 0 < headers < entries * 8192, headers
    assert cases["ram"]["evicting_request_ttft_s_median"] > 0
    assert cases["disk-cold"]["evicting_request_disk_write_s_median"] > 0      # a fresh disk tier each round
    cold = cases["disk-cold"]["page_cache"][0]
    assert cold["method"].startswith("fadvise")
    assert cold["resident_before"] is None or cold["resident_before"] < 0.05
    bw = res["bandwidth"]
    for key in ("seq_cold_Bps", "seq_warm_Bps", "blockfiles_raw_cold_Bps", "sha256_Bps", "disk_tier_cold_Bps"):
        assert bw[key] > 0, key
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]   # the disk tier and read file are gone

    kv = res["kv_bytes_per_token"]
    held = res["tiers"]
    assert held["slot"]["bytes_per_token"] == held["ram"]["bytes_per_token"] == kv   # K+V only
    assert held["ram"]["tokens"] == slot and held["ram"]["restored"] == {"ram": slot}
    assert held["disk"]["restored"] == {"disk-cold": slot, "disk-warm": slot}
    assert kv < held["disk"]["bytes_per_token"] < kv * 1.01                        # + the block files' headers
    if has_redis:                        # whole blocks only: tails stay in the local tiers
        whole = slot // BLOCK_TOKENS * BLOCK_TOKENS
        assert cases["redis"]["cached_tokens"] == cases["redis"]["tokens_by_tier"]["redis"] == whole
        assert held["redis"]["tokens"] == whole and held["redis"]["restored"] == {"redis": whole}
        assert kv < held["redis"]["bytes_per_token"] < kv * 1.01                   # the block files' bytes
        assert held["redis"]["memory_usage_bytes"] >= held["redis"]["bytes"]
        port = int(res["redis"]["url"].rsplit(":", 1)[1].split("/")[0])
        assert not tiers.redis_ready(port)                                              # the bench stopped it


def test_redis_auto_without_the_binary_skips_and_says_why(monkeypatch):
    monkeypatch.setattr(tiers, "REDIS_SERVER", "/nonexistent/redis-server")
    with tiers.redis_for("auto") as r:
        assert r["url"] is None and "/nonexistent/redis-server" in r["skipped"]


@pytest.mark.skipif(not os.access(tiers.REDIS_SERVER, os.X_OK), reason="no redis-server")
def test_local_redis_is_stopped_when_the_block_raises():
    with pytest.raises(KeyError):
        with tiers.local_redis() as url:
            port = int(url.rsplit(":", 1)[1].split("/")[0])
            assert tiers.redis_ready(port)
            raise KeyError("boom")
    assert not tiers.redis_ready(port)
