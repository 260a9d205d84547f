"""No import cycles inside src/ternlm (issue 40): a cycle means two modules that cannot be read, tested
or replaced apart. Every import counts, module-level or inside a function (a lazy import is still a
dependency). The graph comes from the source (ast), so the test needs no module to be importable."""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def modules() -> dict[str, Path]:
    out = {}
    for p in (SRC / "ternlm").rglob("*.py"):
        parts = p.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The ternlm modules `name` imports (a name imported from a package counts as its module if it is one)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        for t in targets:
            while t not in known and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in known and t != name and t.startswith("ternlm"):
                found.add(t)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert graph["ternlm.cli.main"], "the graph sees imports"
    assert cycles(graph) == []


# What each package may import (issue 60; each package's __init__ says the same in words). A package
# not listed may import anything; "<top>" is the helper modules directly under ternlm/ (cpu, sizes, ...).
ALLOWED = {
    "ternlm.text": {"<top>"},
    "ternlm.kv": {"<top>"},
    "ternlm.kernels": {"<top>", "ternlm.kv"},
    "ternlm.linear": {"<top>", "ternlm.kernels"},
    "ternlm.models": {"<top>", "ternlm.kernels", "ternlm.linear", "ternlm.text", "ternlm.kv"},
    "ternlm.engine": {"<top>", "ternlm.kernels", "ternlm.linear", "ternlm.models", "ternlm.text", "ternlm.kv"},
    "ternlm.server": {"<top>", "ternlm.engine", "ternlm.models", "ternlm.text", "ternlm.kv"},
}


def test_packages_import_only_what_their_layer_allows():
    known = modules()
    pkgs = {".".join(n.split(".")[:2]) for n, p in known.items() if p.name == "__init__.py" and n.count(".") == 1}
    where = {n: (".".join(n.split(".")[:2]) if ".".join(n.split(".")[:2]) in pkgs else "<top>") for n in known}
    broken = []
    for name, path in known.items():
        allowed = ALLOWED.get(where[name])
        if allowed is None or name == "ternlm":
            continue
        for dep in imports(name, path, known):
            if where[dep] != where[name] and where[dep] not in allowed:
                broken.append(f"{name} imports {dep}")
    assert not broken, broken


def test_at_most_twelve_modules_at_the_top():
    top = sorted(p.name for p in (SRC / "ternlm").glob("*.py"))
    assert len(top) <= 12, top           # the rest lives in packages by concern
