"""The disk tier: one verified file per KV block under a cache directory, LRU within a byte budget.

    <root>/blocks/<key[:2]>/<key>.tkv         a block (format: blockfile.py)
    <root>/blocks/<loc[:2]>/<loc>.<key>.tkv   a tail entry: locator (its parent + namespace), then key
    <root>/blocks/<key[:2]>/<key>.tmp-<pid>-<rand>   a write in progress (never read; flocked by its writer)
    <root>/.lock                              flock'ed while evicting or clearing

Why it is safe to share and to crash:
- A write goes to a create-only temporary file, is fsynced, then renamed over the final name, and the
  directory is fsynced. A reader sees the old file, the new file or none; never half of one. A
  `kill -9` mid-write leaves only a tmp file, removed by the next scan: its writer's flock died with it.
- Two servers writing one key write identical bytes (the key names the content), so either rename wins.
- Readers verify every file (blockfile.decode). A bad file is logged, deleted and reported as a miss:
  the caller recomputes. Eviction takes the directory lock and rescans, so two servers' budgets
  converge on the files that really exist.
- Out of space (ENOSPC/EDQUOT) turns writes off with one warning; reads go on. Never a crash.
LRU order is file mtime, touched on every hit, so it survives restarts.
Tails: the tails that may follow a block sit in one subdirectory under one locator prefix, so a lookup
lists them (other servers' too) and reads their headers for their ids. Writing a tail or a block
deletes the shorter tails of the same conversation it covers (same parent, ids a prefix of its own):
one tail per conversation branch, not one per turn; and at most `tails_per_parent` (oldest go first).
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import stat
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .blocks import tail_locator
from .blockfile import SUFFIX, BadBlock, BlockKV, BlockMeta, decode, encode, meta_of, read_file_header

log = logging.getLogger("ternlm.cache")

_RESCAN_EVERY = 64              # writes between rescans (notices other servers' files and deletions)
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


@dataclass
class _Entry:
    size: int
    mtime: float


@dataclass
class DiskStats:
    hits: int = 0
    misses: int = 0
    damaged: int = 0             # files found bad and deleted
    writes: int = 0
    write_errors: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    load_s: float = 0.0          # seconds spent reading + verifying hits
    write_s: float = 0.0


def block_path(root: Path, name: bytes) -> Path:
    """The file of an entry named `name` (BlockMeta.name: 32 bytes for a block, 64 for a tail)."""
    h = name.hex()
    stem = h if len(name) == 32 else f"{h[:64]}.{h[64:]}"
    return root / "blocks" / h[:2] / (stem + SUFFIX)


def name_of(filename: str) -> bytes | None:
    """The entry name a file name spells (inverse of block_path); None for anything else."""
    if not filename.endswith(SUFFIX):
        return None
    parts = filename[:-len(SUFFIX)].split(".")
    try:
        raw = b"".join(bytes.fromhex(p) for p in parts)
    except ValueError:
        return None
    return raw if len(parts) <= 2 and all(len(p) == 64 for p in parts) else None


class UntrustedCacheDir(ValueError):
    """A cache directory this process must not use (another user's): one line saying why."""


def secure_dir(root: Path) -> None:
    """Make `root` a directory only its owner can enter: block headers hold token ids, i.e. the
    conversations. Creates it 0700 when missing; an existing one must belong to this user (else
    UntrustedCacheDir: its owner could read every conversation, or swap files under us), and loses its
    group/other permission bits (logged). Raises OSError when it cannot be created or is no directory."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.stat(root)                     # follows a symlink: what matters is the directory used
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(root))
    if st.st_uid != os.geteuid():
        raise UntrustedCacheDir(
            f"cache directory {root} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
            f"refusing it, its owner could read the conversations stored there; choose another --cache-dir")
    if st.st_mode & 0o077:
        os.chmod(root, 0o700)
        log.warning("disk KV cache: %s was mode %o, readable by others; now 0700", root, stat.S_IMODE(st.st_mode))


def _writer_gone(path: str) -> bool:
    """Whether no process holds the write lock of a tmp file. Every writer flocks its tmp file for the
    whole write, and the kernel drops the lock when the writer dies, so this holds across containers
    and pid namespaces sharing the directory (a pid in the file name would not: it may be another
    namespace's, or reused)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False                       # already gone, or not ours to judge
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False                       # a live writer holds it
    finally:
        os.close(fd)                       # drops our probe lock too


def scan(root: Path, clean_tmp: bool = True) -> dict[bytes, tuple[Path, int, float]]:
    """key -> (path, size, mtime) of every block file; removes tmp files no live writer holds."""
    found: dict[bytes, tuple[Path, int, float]] = {}
    base = root / "blocks"
    if not base.is_dir():
        return found
    for sub in os.scandir(base):
        if not sub.is_dir(follow_symlinks=False):
            continue
        for f in os.scandir(sub.path):
            name = f.name
            if name.endswith(SUFFIX) and f.is_file(follow_symlinks=False):
                key = name_of(name)
                try:
                    st = f.stat(follow_symlinks=False)
                except OSError:
                    continue
                if key is not None:
                    found[key] = (Path(f.path), st.st_size, st.st_mtime)
            elif clean_tmp and ".tmp-" in name and _writer_gone(f.path):
                unlink_quiet(Path(f.path))
    return found


@contextmanager
def dir_lock(root: Path):
    """Exclusive flock on <root>/.lock (held while evicting or clearing)."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def unlink_quiet(path: Path) -> None:
    """Remove a file; one already gone (another server evicted it) is not an error."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _read_meta(path: Path) -> BlockMeta:
    """The header of a block file as a BlockMeta, reading only the header bytes. Raises BadBlock,
    OSError."""
    return meta_of(read_file_header(path))


class DiskTier:
    """Thread-safe for one reader (the engine's worker: has/get) beside one writer (the spill thread:
    put): `_lock` guards the index and counters; file I/O runs outside it. Other processes may share
    `root`."""

    def __init__(self, root: Path, budget: int, tails_per_parent: int = 16):
        self.root = Path(root)
        self.budget = budget
        self.tails_per_parent = tails_per_parent
        self.stats = DiskStats()
        self.write_disabled: str | None = None     # why writes are off (e.g. disk full); reads go on
        self._lock = threading.RLock()
        self._index: dict[bytes, _Entry] = {}
        self._used = 0
        self._since_scan = 0
        try:
            # Block headers hold token ids, i.e. the conversations: owner-only, like the files (0o600).
            # Another user's directory raises UntrustedCacheDir (not degraded to "no disk tier").
            secure_dir(self.root)
            (self.root / "blocks").mkdir(mode=0o700, exist_ok=True)
            self._rescan()
        except OSError as e:
            self._disable(f"cannot use {self.root}: {e}")

    # ---- bookkeeping ---------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def blocks(self) -> int:
        """Block files known (a property, not __len__: an empty tier must not be falsy)."""
        return len(self._index)

    def _rescan(self) -> None:
        found = scan(self.root)
        with self._lock:
            self._index = {k: _Entry(size, mtime) for k, (_, size, mtime) in found.items()}
            self._used = sum(e.size for e in self._index.values())
            self._since_scan = 0

    def _disable(self, why: str) -> None:
        if self.write_disabled is None:
            log.warning("disk KV cache: %s; continuing without writing to the disk tier", why)
        self.write_disabled = why

    def _forget(self, key: bytes) -> None:
        with self._lock:
            e = self._index.pop(key, None)
            if e is not None:
                self._used -= e.size

    def _remember(self, key: bytes, size: int, mtime: float) -> None:
        with self._lock:
            old = self._index.get(key)
            self._used += size - (old.size if old is not None else 0)
            self._index[key] = _Entry(size, mtime)

    # ---- reads ---------------------------------------------------------------------------------
    def has(self, key: bytes) -> bool:
        """Whether a file for `key` exists (index first, then a stat: another server may have written it).
        Does not verify; `get` does."""
        with self._lock:
            if key in self._index:
                return True
        try:
            st = os.stat(block_path(self.root, key))
        except OSError:
            return False
        self._remember(key, st.st_size, st.st_mtime)
        return True

    def tail_heads(self, locator: bytes) -> list[BlockMeta]:
        """The headers of the tail files following one parent (tail_locator), any server's. Reads
        headers only (the payload is verified by `get`); a file whose header is bad is dropped."""
        prefix = locator.hex() + "."
        out = []
        try:
            entries = [e for e in os.scandir(self.root / "blocks" / prefix[:2])
                       if e.name.startswith(prefix) and e.name.endswith(SUFFIX)]
        except OSError:
            return out
        for e in entries:
            name = name_of(e.name)
            if name is None:
                continue
            try:
                meta = _read_meta(Path(e.path))
                if not meta.tail or meta.name != name:
                    raise BadBlock("file name and header differ")
            except FileNotFoundError:
                self._forget(name)
                continue
            except (BadBlock, OSError) as err:
                reason = err.reason if isinstance(err, BadBlock) else f"cannot read: {err!r}"
                self._drop(Path(e.path), name, reason)
                continue
            out.append(meta)
        return out

    def get(self, expect: BlockMeta) -> BlockKV | None:
        """Read and verify the entry `expect.name`; None on a miss. A bad file is logged, deleted and
        counted as damaged (the caller recomputes). Side effect: touches the file's mtime (LRU)."""
        path = block_path(self.root, expect.name)
        key = expect.name
        t0 = time.perf_counter()
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                buf = bytearray(size)
                got = f.readinto(buf)
        except FileNotFoundError:
            self._forget(key)
            self.stats.misses += 1
            return None
        except Exception as e:      # EIO, EACCES, MemoryError for an absurd file: a miss, never a 500
            return self._drop(path, key, f"cannot read: {e!r}")
        try:
            if got != size:
                raise BadBlock("short read (file changed while reading)")
            block = decode(buf, expect)     # raises BadBlock only, whatever the bytes
        except BadBlock as e:
            return self._drop(path, key, e.reason)
        now = time.time()
        try:
            os.utime(path, (now, now))
        except OSError:
            pass
        self._remember(key, size, now)
        self.stats.hits += 1
        self.stats.bytes_read += size
        self.stats.load_s += time.perf_counter() - t0
        return block

    def _drop(self, path: Path, key: bytes, reason: str) -> None:
        """A file that failed to read or verify: logged, counted, removed, so the prefix is recomputed
        once and the next write replaces it (left in place it would fail every later request)."""
        log.warning("disk KV cache: dropped %s: %s", path.name, reason)
        self.stats.damaged += 1
        self.stats.misses += 1
        try:
            unlink_quiet(path)
        except OSError as e:
            log.warning("disk KV cache: cannot remove %s: %s", path.name, e)
        self._forget(key)
        return None

    # ---- writes --------------------------------------------------------------------------------
    def put(self, block: BlockKV) -> bool:
        """Write a block (atomic, fsynced) unless present (a present file is replaced only by one that
        adds a recurrent state, which makes it longer); evict LRU files to stay within budget.
        Returns whether the block is on disk afterwards. Never raises for I/O trouble.
        A tail deletes the shorter tails of its conversation (same parent, ids a prefix of its own)."""
        key = block.meta.name
        if self.write_disabled is not None:
            return False
        with self._lock:
            if key in self._index and block.state is None:
                return True
        header, payload = encode(block.meta, block.k, block.v, block.state)
        size = len(header) + sum(len(p) for p in payload)
        with self._lock:     # a file of this key without the recurrent state this one carries is replaced
            if key in self._index and self._index[key].size >= size:
                return True
        if size > self.budget:
            return False
        self._since_scan += 1
        if self._used + size > self.budget or self._since_scan >= _RESCAN_EVERY:
            # evict 5% below the need: a full tier then rescans once per many writes, not per write
            self._evict(self.budget - size - (self.budget // 20 if self._used + size > self.budget else 0))
        path = block_path(self.root, key)
        tmp = path.with_name(f"{path.stem}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        t0 = time.perf_counter()
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)     # held until close: tells scan() the writer lives
                for part in (header, *payload):
                    view = memoryview(part)
                    while view:
                        view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as e:
            unlink_quiet(tmp)
            self.stats.write_errors += 1
            if e.errno in _NO_SPACE:
                self._disable(f"no space left in {self.root} ({e.strerror})")
            else:
                log.warning("disk KV cache: writing %s failed: %s", path.name, e)
            return False
        self._remember(key, size, time.time())
        self.stats.writes += 1
        self.stats.bytes_written += size
        self.stats.write_s += time.perf_counter() - t0
        self._prune_tails(block.meta)
        return True

    def _prune_tails(self, newer: BlockMeta) -> None:
        """Delete the tails an entry just written replaces: those after the same parent whose ids are
        a strict prefix of its ids (the conversation grew, within the block or past it), then the
        oldest beyond `tails_per_parent` (a lookup reads every header under one locator)."""
        loc = tail_locator(newer.parent, newer.namespace)
        heads = self.tail_heads(loc)
        kept = []
        for meta in heads:
            if len(meta.ids) < len(newer.ids) and newer.ids[:len(meta.ids)] == meta.ids:
                unlink_quiet(block_path(self.root, meta.name))
                self._forget(meta.name)
            else:
                kept.append(meta)
        if len(kept) > self.tails_per_parent:
            with self._lock:
                age = {m.name: self._index[m.name].mtime if m.name in self._index else 0.0 for m in kept}
            for meta in sorted(kept, key=lambda m: age[m.name])[:len(kept) - self.tails_per_parent]:
                unlink_quiet(block_path(self.root, meta.name))
                self._forget(meta.name)
                self.stats.evictions += 1

    def _evict(self, target: int) -> None:
        """Delete least recently used files until at most `target` bytes are used. Rescans under the
        directory lock first, so files of other servers sharing the directory count too."""
        try:
            with dir_lock(self.root):
                self._rescan()
                with self._lock:
                    oldest = sorted(self._index.items(), key=lambda kv: kv[1].mtime)
                for key, _ in oldest:
                    if self._used <= target:
                        break
                    unlink_quiet(block_path(self.root, key))
                    self._forget(key)
                    self.stats.evictions += 1
        except OSError as e:
            log.warning("disk KV cache: eviction failed: %s", e)
