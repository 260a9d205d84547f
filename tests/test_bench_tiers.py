"""`ternlm bench tiers`, tiny: smollm2-135m float32, a ~520-token conversation, one round, no warm-up.

One run checks the whole path: every case restores from the tier it is named after (slot, RAM, disk
with the page cache dropped and warm, nothing), the results JSON says so, the temporary disk tier is
removed, and the identity check fails the run when one case's logits differ by one ulp-sized nudge
(injected into disk-warm only: the other cases must still be bit-identical to the cold prefill).
No timing assertions.
"""
from __future__ import annotations

import json
import sys

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
    assert list(cases) == ["slot", "ram", "disk-cold", "disk-warm", "none"]
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
