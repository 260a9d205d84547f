"""Hostile cache files: whatever bytes a block file holds, reading it gives a block or BadBlock, and the
disk tier turns every failure into a miss (logged, counted, file removed, prefix recomputed), never an
exception that reaches a request. Fuzzed with hypothesis: random bytes, random JSON headers (any
types, deep nesting, huge numbers, Infinity), truncations and absurd lengths.
"""
from __future__ import annotations

import dataclasses
import json
import os
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from ternlm.kv.blockfile import MAGIC, BadBlock, BlockKV, decode, meta_of, read_header
from ternlm.kv.disk import DiskTier, block_path
from test_kv_store import B, file_bytes, make_block, rand_ids

# `make test` runs a few hundred examples per property; RESULTS.md's figures come from a long run:
# TERNLM_FUZZ_SCALE=100 pytest tests/test_kv_fuzz.py (100x the examples)
SCALE = int(os.environ.get("TERNLM_FUZZ_SCALE", "1"))

BLK = make_block(rand_ids(2 * B, 7), 1)
GOOD = bytes(file_bytes(BLK))
HEADER, OFF = read_header(GOOD)
PAYLOAD = GOOD[OFF:]


# a hybrid model's entry: the recurrent state (conv (R, C, K - 1), ssm (R, H, dk, dv)) after v's bytes
STATE_SHAPES = ((2, 6, 3), (2, 2, 4, 4))
SBLK = BlockKV(dataclasses.replace(BLK.meta, state=STATE_SHAPES), BLK.k, BLK.v,
               tuple(torch.randn(s) for s in STATE_SHAPES))
SGOOD = bytes(file_bytes(SBLK))
SHEADER, SOFF = read_header(SGOOD)
SPAYLOAD = SGOOD[SOFF:]


def with_header(header: object, payload: bytes = PAYLOAD, raw: bytes | None = None) -> bytes:
    body = raw if raw is not None else json.dumps(header, allow_nan=True).encode()
    return MAGIC + struct.pack("<I", len(body)) + body + payload


def only_block_or_bad(data: bytes, expect=BLK.meta) -> None:
    """The property: decode (and the header readers `cache ls` uses) return or raise BadBlock."""
    for exp in (expect, None):
        try:
            decode(bytearray(data), exp)
        except BadBlock:
            pass
    try:
        meta_of(read_header(data)[0])
    except BadBlock:
        pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=20)


@settings(max_examples=300 * SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=4096))
def test_random_bytes(data):
    only_block_or_bad(data)
    only_block_or_bad(MAGIC + data)


@settings(max_examples=400 * SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(HEADER)), json_values)
def test_one_header_field_replaced_by_anything(field, value):
    only_block_or_bad(with_header({**HEADER, field: value}))


@settings(max_examples=300 * SCALE, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(SHEADER)), json_values)
def test_a_state_entry_with_one_header_field_replaced_by_anything(field, value):
    only_block_or_bad(with_header({**SHEADER, field: value}, SPAYLOAD), SBLK.meta)
    only_block_or_bad(with_header({**SHEADER, "state": {"conv": value, "ssm": value}}, SPAYLOAD), SBLK.meta)


@settings(max_examples=200 * SCALE, deadline=None)
@given(st.integers(min_value=0, max_value=len(SGOOD)))
def test_every_truncation_of_a_state_entry(cut):
    only_block_or_bad(SGOOD[:cut], SBLK.meta)
    if cut < len(SGOOD):
        with pytest.raises(BadBlock):
            decode(bytearray(SGOOD[:cut]), SBLK.meta)


def test_a_state_entry_round_trips_and_is_checked_against_the_request():
    back = decode(bytearray(SGOOD), SBLK.meta)
    assert all(a.equal(b) for a, b in zip(back.state, SBLK.state)) and back.k.equal(BLK.k)
    with pytest.raises(BadBlock, match="recurrent state shape"):
        decode(bytearray(SGOOD), BLK.meta)                    # a store whose model has no recurrent layers
    with pytest.raises(BadBlock, match="truncated payload"):  # the state's bytes cut off, header unchanged
        decode(bytearray(with_header(SHEADER, PAYLOAD)), SBLK.meta)


@settings(max_examples=100 * SCALE, deadline=None)
@given(st.dictionaries(st.text(max_size=12), json_values, max_size=12))
def test_random_json_headers(header):
    only_block_or_bad(with_header(header))


@settings(max_examples=200 * SCALE, deadline=None)
@given(st.integers(min_value=0, max_value=len(GOOD)))
def test_every_truncation(cut):
    only_block_or_bad(GOOD[:cut])


def test_the_holes_seen():
    """The exceptions a careful read found (each escaped decode as a non-BadBlock before)."""
    cases = {
        "payload_bytes not a number": with_header({**HEADER, "payload_bytes": "abc"}),
        "payload_bytes Infinity": with_header({**HEADER, "payload_bytes": float("inf")}),
        "deep nesting": with_header(None, raw=b"[" * 100_000 + b"]" * 100_000),
        "token id past int32": with_header({**HEADER, "ids": [2**40] * B}),
        "shape of floats": with_header({**HEADER, "shape": [1e308, 2, B, 4]}),
        "absurd header length": MAGIC + struct.pack("<I", 2**32 - 1) + b"{}",
    }
    for name, data in cases.items():
        with pytest.raises(BadBlock):
            decode(bytearray(data), BLK.meta)
        only_block_or_bad(data)


@pytest.mark.parametrize("kind", ["payload_bytes", "deep", "id_range"])
def test_disk_tier_drops_a_hostile_file_and_recovers(tmp_path, caplog, kind):
    """One bad file must not break a prefix for good: the read is a miss, the file goes, the next
    write puts a good one back and the read after that hits."""
    tier = DiskTier(tmp_path, 1 << 30)
    assert tier.put(BLK)
    path = block_path(tmp_path, BLK.meta.key)
    hostile = {"payload_bytes": with_header({**HEADER, "payload_bytes": "abc"}),
               "deep": with_header(None, raw=b"{\"a\":" * 50_000 + b"1" + b"}" * 50_000),
               "id_range": with_header({**HEADER, "ids": [-(2**40)] * B})}[kind]
    path.write_bytes(hostile)
    caplog.set_level("WARNING", logger="ternlm.cache")
    assert tier.get(BLK.meta) is None
    assert tier.stats.damaged == 1 and tier.stats.misses == 1
    assert not path.exists() and "dropped" in caplog.text
    assert tier.put(BLK)
    back = tier.get(BLK.meta)
    assert back is not None and back.k.equal(BLK.k)


def test_tmp_files_are_judged_by_their_writers_lock_not_a_pid(tmp_path):
    """Containers sharing a cache directory see each other's pids as meaningless numbers: a tmp file
    whose name holds a pid alive here (pid 1) may be an orphan of another namespace, and one whose pid
    is dead here may have a live writer elsewhere. The writer's flock decides."""
    import fcntl
    import os
    from ternlm.kv.disk import scan
    shard = tmp_path / "blocks" / "ab"
    shard.mkdir(parents=True)
    orphan = shard / "ab00.tmp-1-0000"                  # pid 1 lives, but nobody writes this file
    orphan.write_bytes(b"half a block")
    live = shard / "ab01.tmp-999999999-0000"            # no such pid here, but a writer holds it
    live.write_bytes(b"being written")
    fd = os.open(live, os.O_WRONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        scan(tmp_path)
        assert not orphan.exists() and live.exists()
    finally:
        os.close(fd)                                     # the writer dies: its lock goes with it
    scan(tmp_path)
    assert not live.exists()
