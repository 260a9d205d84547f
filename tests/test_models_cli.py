"""`ternlm models`: every registry entry listed, a cached one marked with its path, nothing created.

The CLI runs in a subprocess (the real entry point and rich's output to a pipe) against a private
XDG cache in which one registry file is faked: a sparse file of the registry's size under the
registry's file name (what `cached_file` looks for; `models` does not hash, pull and load do)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ternlm.models.registry import REGISTRY

CACHED = "smollm2-135m"


@pytest.fixture
def xdg(tmp_path):
    """A private XDG_CACHE_HOME holding a stand-in for CACHED's file (sparse: no disk used)."""
    models = tmp_path / "ternlm" / "models"
    models.mkdir(parents=True)
    entry = REGISTRY[CACHED]
    with open(models / entry.filename, "wb") as f:
        f.truncate(entry.size)
    (models / REGISTRY["qwen2.5-coder-0.5b"].filename).write_bytes(b"GGUF")   # wrong size: not cached
    return tmp_path


def _models(xdg, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CACHE_HOME": str(xdg)}
    return subprocess.run([sys.executable, "-m", "ternlm.cli.main", "models", *flags], env=env, capture_output=True,
                          text=True, timeout=120)


def test_table_lists_every_entry_and_marks_the_cached_one(xdg):
    out = _models(xdg)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["name", "size", "arch", "quant", "context", "licence", "cached"]
    for name, e in REGISTRY.items():
        row = next(line for line in lines if line.startswith(name + " "))
        cols = row.split()
        assert e.architecture in cols and e.quantization in cols and e.licence in cols, row
        assert f"{e.context:,}" in cols, row
        assert cols[-1] == ("yes" if name == CACHED else "no"), row
    assert "93.8 MiB" in next(line for line in lines if line.startswith(CACHED)), "size in human units"
    path = xdg / "ternlm" / "models" / REGISTRY[CACHED].filename
    assert f"{CACHED}: {path}" in lines, "the cached file's path, whole, on its own line"
    assert sum(str(xdg) in line for line in lines) == 1, "only the cached entry has a path"
    assert "ternlm pull NAME" in out.stdout


def test_json_is_the_same_rows(xdg):
    out = _models(xdg, "--json")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["name"] for r in rows] == list(REGISTRY)
    for r in rows:
        e = REGISTRY[r["name"]]
        assert (r["size"], r["architecture"], r["quantization"], r["context"], r["licence"], r["sha256"]) == \
            (e.size, e.architecture, e.quantization, e.context, e.licence, e.sha256)
        expected = str(xdg / "ternlm" / "models" / e.filename) if r["name"] == CACHED else None
        assert r["cached"] == expected
    assert [r["name"] for r in rows if r["default"]] == ["smollm2-135m"]


def test_an_empty_cache_lists_all_and_creates_nothing(tmp_path):
    out = _models(tmp_path)
    assert out.returncode == 0, out.stderr
    assert all(line.split()[-1] == "no" for line in out.stdout.splitlines()[1:len(REGISTRY) + 1])
    assert list(tmp_path.iterdir()) == [], "listing must not create the cache directory"
