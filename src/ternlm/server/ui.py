"""The chat page: `GET /` and `GET /static/{name}`, plain files shipped as package data.

Why an allowlist: the only names served are the files found in static/ when this module is imported,
mapped to their paths and media types here. A request's `name` is a dictionary key and nothing else,
so no path from a request (`..`, `%2e%2e`, absolute, symlink tricks) ever reaches the filesystem.
Why these headers: the page shows model output, which is attacker-controllable text. It renders it
with DOM nodes (never innerHTML), and the Content-Security-Policy is the second wall: no inline script,
no remote script, style, font or connection, so even a rendering bug cannot load or exfiltrate anything.
The page itself needs no key (it holds no secret); the API calls it makes are authenticated as usual.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

from .errors import APIError

STATIC_DIR = Path(__file__).resolve().parent / "static"

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}

_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png",
          ".ico": "image/x-icon"}


def _allowlist(folder: Path) -> dict[str, tuple[Path, str]]:
    """name -> (path, media type) for the plain files directly in `folder` with a known type."""
    if not folder.is_dir():
        return {}
    return {p.name: (p, _TYPES[p.suffix]) for p in sorted(folder.iterdir())
            if p.is_file() and not p.is_symlink() and p.suffix in _TYPES and not p.name.startswith(".")}


FILES = _allowlist(STATIC_DIR)     # built once, at import


def _send(name: str) -> Response:
    entry = FILES.get(name)
    if entry is None:
        raise APIError(404, f"no such file: /static/{name}"[:200], code="not_found")
    path, media_type = entry
    # read per request (files are a few KB): an upgraded package is served without a restart
    return Response(path.read_bytes(), media_type=media_type, headers=HEADERS)


def mount_ui(app: FastAPI) -> None:
    """Add `GET /` (index.html) and `GET /static/{name}` to `app`. Touches nothing else."""

    @app.get("/", include_in_schema=False)
    async def index() -> Response:
        return _send("index.html")

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        return _send(name)
