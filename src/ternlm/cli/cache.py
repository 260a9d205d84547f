"""`ternlm cache ls|stats|verify|clear [--cache-dir DIR]`: look after the disk tier of the KV cache.

Safe beside running servers: listing reads headers only, verify reads each file once and deletes
only files that fail verification (a server would delete them on its next read anyway), and clear
holds the directory lock that servers take to evict, removing whole files with unlink (a server
reading one keeps its open copy and verifies it).
"""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from ..kv.blockfile import BadBlock, decode, meta_of, read_file_header
from ..kv.disk import unlink_quiet, dir_lock, scan
from ..sizes import format_size


def add_cache_parser(subparsers) -> None:
    from ..server.cli import default_kv_dir
    p = subparsers.add_parser("cache", help="inspect, verify or clear the on-disk KV cache",
                              description="The disk tier that `ternlm serve` keeps KV blocks in.")
    sub = p.add_subparsers(dest="cache_cmd", required=True)
    for name, help_, func in (("ls", "list blocks (newest first)", cmd_ls),
                              ("stats", "totals per model", cmd_stats),
                              ("verify", "check every block file; delete damaged ones", cmd_verify),
                              ("clear", "delete every block", cmd_clear)):
        q = sub.add_parser(name, help=help_)
        q.add_argument("--cache-dir", default=default_kv_dir(), help="default $XDG_CACHE_HOME/ternlm/kv")
        q.set_defaults(func=func)
        if name == "verify":
            q.add_argument("--dry-run", action="store_true", help="report damaged files, delete nothing")
        if name == "ls":
            q.add_argument("-n", "--limit", type=int, default=50, help="rows to show (0: all)")


def _head(path: Path) -> dict:
    """The header of a block file, reading only the header bytes (validated as a BlockMeta). Raises BadBlock."""
    header = read_file_header(path)
    meta_of(header)
    return header


def _root(args) -> Path:
    root = Path(args.cache_dir).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"no KV cache at {root}")
    return root


def cmd_ls(args) -> int:
    root = _root(args)
    files = sorted(scan(root, clean_tmp=False).items(), key=lambda kv: -kv[1][2])
    print(f"{'key':<14} {'parent':<14} {'model':<14} {'dtype':<16} {'size':>10}  last used")
    shown = files if args.limit <= 0 else files[:args.limit]
    for key, (path, size, mtime) in shown:
        try:
            h = _head(path)
            parent, model, dtype = h["parent"][:12], h["model_sha256"][:12], h["dtype"]
        except (BadBlock, OSError) as e:
            parent, model, dtype = "?", f"(bad: {e})", ""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime))
        print(f"{key.hex()[:12]:<14} {parent:<14} {model:<14} {dtype:<16} {format_size(size):>10}  {when}")
    if len(files) > len(shown):
        print(f"... {len(files) - len(shown)} more (use -n 0 for all)")
    return 0


def cmd_stats(args) -> int:
    root = _root(args)
    files = scan(root, clean_tmp=False)
    per: Counter[tuple[str, str]] = Counter()
    per_bytes: Counter[tuple[str, str]] = Counter()
    unreadable = 0
    for path, size, _ in files.values():
        try:
            h = _head(path)
            k = (h["model_sha256"][:12], h["dtype"])
        except (BadBlock, OSError):
            unreadable += 1
            k = ("(unreadable)", "")
        per[k] += 1
        per_bytes[k] += size
    total = sum(size for _, size, _ in files.values())
    print(f"{root}: {len(files)} blocks, {format_size(total)}")
    if files:
        times = [m for _, _, m in files.values()]
        fmt = "%Y-%m-%d %H:%M:%S"
        print(f"oldest {time.strftime(fmt, time.localtime(min(times)))}, "
              f"newest {time.strftime(fmt, time.localtime(max(times)))}")
    for (model, dtype), n in per.most_common():
        print(f"  model {model} {dtype}: {n} blocks, {format_size(per_bytes[(model, dtype)])}")
    if unreadable:
        print(f"{unreadable} blocks have unreadable headers: run `ternlm cache verify`")
    return 0


def cmd_verify(args) -> int:
    root = _root(args)
    files = scan(root, clean_tmp=not args.dry_run)
    bad = 0
    for key, (path, _, _) in sorted(files.items()):
        try:
            data = bytearray(path.read_bytes())
            block = decode(data)
            if block.meta.name != key:
                raise BadBlock("file name and header key differ")
        except FileNotFoundError:
            continue                     # evicted by a server meanwhile
        except (BadBlock, OSError) as e:
            bad += 1
            action = "kept (dry run)" if args.dry_run else "deleted"
            print(f"damaged {path.name}: {e} -> {action}")
            if not args.dry_run:
                unlink_quiet(path)
    print(f"verified {len(files)} blocks: {len(files) - bad} good, {bad} damaged")
    return 1 if bad else 0


def cmd_clear(args) -> int:
    root = _root(args)
    with dir_lock(root):
        files = scan(root)
        freed = 0
        for path, size, _ in files.values():
            unlink_quiet(path)
            freed += size
    print(f"removed {len(files)} blocks ({format_size(freed)}) from {root}")
    return 0

