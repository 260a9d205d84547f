"""`ternlm models [--json]`: the registry as a menu. Name, size, architecture, quantization, context,
licence, and whether the file is already in the local cache (and where). Reads the registry and
stats the cache; downloads, hashes and creates nothing."""
from __future__ import annotations

import json
import sys

from ..models.registry import DEFAULT_MODEL, REGISTRY, RegistryEntry, cached_file
from ..sizes import format_size


def add_models_parser(subparsers) -> None:
    p = subparsers.add_parser("models", help="list the registry's models and which are cached here",
                              description="Every name `-m` accepts besides a local .gguf file or Hugging "
                                          "Face folder; `ternlm pull NAME` fetches one ahead of time.")
    p.add_argument("--json", action="store_true", help="machine-readable: a JSON list, one object per model")
    p.set_defaults(func=cmd_models)


def rows() -> list[dict]:
    """One plain dict per registry entry, in registry order. `cached` is the cache path or None
    (present at the registry's size; the sha256 is checked on pull and load, not here)."""
    return [_row(e) for e in REGISTRY.values()]


def _row(e: RegistryEntry) -> dict:
    path = cached_file(e)
    return {"name": e.name, "default": e.name == DEFAULT_MODEL, "description": e.description,
            "size": e.size, "architecture": e.architecture, "quantization": e.quantization,
            "context": e.context, "licence": e.licence, "sha256": e.sha256,
            "cached": str(path) if path is not None else None}


def cmd_models(args) -> int:
    """Prints the table (or JSON with --json) to stdout. Side effects: none beyond stat calls."""
    data = rows()
    if args.json:
        json.dump(data, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for col, justify in (("name", "left"), ("size", "right"), ("arch", "left"), ("quant", "left"),
                         ("context", "right"), ("licence", "left"), ("cached", "left")):
        table.add_column(col, justify=justify, no_wrap=True)
    for r in data:
        table.add_row(r["name"] + (" (default)" if r["default"] else ""), format_size(r["size"]),
                      r["architecture"], r["quantization"], f"{r['context']:,}", r["licence"],
                      "yes" if r["cached"] else "no")
    Console(width=None if sys.stdout.isatty() else 1000).print(table)   # piped: rich's 80 columns would cut
    # paths below the table, plain: whole and grep-able at any terminal width
    print()
    for r in data:
        if r["cached"]:
            print(f"{r['name']}: {r['cached']}")
    if not all(r["cached"] for r in data):
        print("not cached: `ternlm pull NAME` fetches and verifies one ahead of time (else its first load does)")
    return 0
