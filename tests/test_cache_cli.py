"""`ternlm cache ls|stats|verify|clear` on a directory filled by the real disk tier (fake KV)."""
from __future__ import annotations

import os

from ternlm.cli.main import main
from test_kv_store import IDENT, B, fake_slot, rand_ids
from ternlm.kv.store import StoreIdentity, TieredStore


def fill(root, n_convs: int = 2, ident=IDENT, ns: bytes = b"ns-model-a") -> list:
    store = TieredStore(ident, 0, root, 1 << 30)
    for i in range(n_convs):
        store.save(fake_slot(rand_ids(2 * B, 50 + i), ns))     # whole blocks: no tail entry
    assert store.flush(30)
    return sorted(root.rglob("*.tkv"))


def test_ls_stats_verify_clear(tmp_path, capsys):
    files = fill(tmp_path)
    fill(tmp_path, 1, StoreIdentity("c" * 64, "torch.bfloat16", 2, 2, 4), b"ns-model-c")   # another model
    assert len(files) == 4
    assert main(["cache", "ls", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("aaaaaaaaaaaa") == 4 and out.count("cccccccccccc") == 2
    assert "000000000000" in out                                  # block 0 of a chain: the root parent
    assert main(["cache", "stats", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "6 blocks" in out and "model aaaaaaaaaaaa torch.float32: 4 blocks" in out
    assert "model cccccccccccc torch.bfloat16: 2 blocks" in out

    assert main(["cache", "verify", "--cache-dir", str(tmp_path)]) == 0
    assert "6 good, 0 damaged" in capsys.readouterr().out
    files[0].write_bytes(files[0].read_bytes()[:-10])             # truncated
    data = bytearray(files[1].read_bytes())
    data[100] ^= 0xFF                                             # header byte flipped
    files[1].write_bytes(bytes(data))
    files[2].rename(files[3])                                     # right file, wrong name
    (files[0].parent / (files[0].stem + ".tmp-999999999-ab")).write_bytes(b"partial")   # dead writer
    assert main(["cache", "verify", "--dry-run", "--cache-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "3 damaged" in out and "kept (dry run)" in out and files[0].exists()
    assert main(["cache", "verify", "--cache-dir", str(tmp_path)]) == 1
    assert "3 damaged" in capsys.readouterr().out
    assert not files[0].exists() and not files[1].exists() and not files[3].exists()
    assert not list(tmp_path.rglob("*.tmp-*"))
    assert main(["cache", "verify", "--cache-dir", str(tmp_path)]) == 0
    assert "2 good, 0 damaged" in capsys.readouterr().out

    assert main(["cache", "clear", "--cache-dir", str(tmp_path)]) == 0
    assert "removed 2 blocks" in capsys.readouterr().out
    assert not list(tmp_path.rglob("*.tkv"))


def test_missing_directory_is_a_clear_error(tmp_path, capsys):
    assert main(["cache", "stats", "--cache-dir", str(tmp_path / "nope")]) == 2
    assert "no KV cache at" in capsys.readouterr().err
    assert os.path.isdir(tmp_path) and not (tmp_path / "nope").exists()


def test_sizes_parse_as_people_write_them():
    import pytest
    from ternlm.sizes import parse_size
    assert parse_size("2GiB") == 2 << 30 and parse_size("2G") == 2 << 30 and parse_size("2GB") == 2 * 10**9
    assert parse_size("500MB") == 500 * 10**6 and parse_size("1.5 MiB") == 3 << 19
    assert parse_size("0") == 0 and parse_size("4096") == 4096
    for bad in ("", "-1G", "2XB", "G", "1e9"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)
