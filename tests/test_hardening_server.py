"""Hostile and multi-tenant use of a real `ternlm serve` process (official openai client and raw HTTP):
- with --api-key the disk tier is opt-in: no --cache-dir, nothing of any conversation reaches disk;
- /slots shows a key its own tenant's slots only, an --admin-key all of them;
- --max-body: a larger body is a 413 with an OpenAI error body, and the server carries on;
- --cors-origins: preflight answered, the header on answers, streams and errors, for listed origins only;
- a cache directory owned by another user is refused at start in one line; ours with loose
  permissions is tightened to 0700.
"""
from __future__ import annotations

import os
import stat
import subprocess
import sys

import httpx2 as httpx
import pytest
from openai import OpenAI

from server_proc import ServerProc

COMMON = ("-m", "smollm2-135m", "--dtype", "float32", "--threads", "1")
ALICE, BOB, ROOT = "key-alice", "key-bob", "key-admin"
WEB_APP = "http://app.example.test:5173"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A multi-tenant server given no --cache-dir, its XDG cache pointed at a fresh folder."""
    xdg = tmp_path_factory.mktemp("xdg")
    p = ServerProc(*COMMON, "--slots", "3", "--api-key", ALICE, BOB, "--admin-key", ROOT, "--max-body", "2KiB",
                   "--cors-origins", WEB_APP, env={"XDG_CACHE_HOME": str(xdg)}, default_cache_dir=False)
    try:
        p.start()
        p.wait_ready()
        yield p, xdg
        p.stop()                 # SIGTERM: a clean drain (uvicorn then re-raises the signal)
        assert "Traceback" not in p.log(), p.log()[-4000:]
    finally:
        p.close()


def ask(server: ServerProc, key: str, text: str):
    c = OpenAI(base_url=server.v1, api_key=key, max_retries=0, timeout=120)
    return c.chat.completions.create(model="smollm2-135m", max_tokens=4, temperature=0,
                                     messages=[{"role": "user", "content": text}])


def test_api_keys_keep_conversations_off_disk_and_slots_private(keyed):
    server, xdg = keyed
    ask(server, ALICE, "Alice asks about the colour of the sea on a calm summer day.")
    ask(server, BOB, "Bob asks about the tallest mountain in the Alps and its height.")
    see = {}
    for key in (ALICE, BOB, ROOT):
        r = httpx.get(server.base + "/slots", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 200
        see[key] = {s["namespace"] for s in r.json()["slots"]}
    assert len(see[ALICE]) == 1 and len(see[BOB]) == 1 and see[ALICE] != see[BOB]
    assert see[ALICE] | see[BOB] <= see[ROOT]
    assert httpx.get(server.base + "/slots", timeout=30).status_code == 401
    assert "disk KV tier off: with --api-key it is opt-in" in server.log()
    assert not (xdg / "ternlm" / "kv").exists()


def test_body_over_max_body_is_413_and_the_server_carries_on(keyed):
    server, _ = keyed
    big = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "a" * 4096}]}
    r = httpx.post(server.v1 + "/chat/completions", json=big, headers={"Authorization": f"Bearer {ALICE}"},
                   timeout=30)
    assert r.status_code == 413
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and "2048" in err["message"]
    assert ask(server, ALICE, "Still there?").choices[0].message.content is not None


def serve_fails(cache_dir: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ternlm.cli.main", "serve", *COMMON, "--port", "1",
                           "--cache-dir", cache_dir], capture_output=True, text=True, timeout=120)


def test_a_cache_dir_of_another_user_is_refused_in_one_line(tmp_path):
    if os.geteuid() == 0:
        foreign = tmp_path / "foreign"
        foreign.mkdir()
        os.chown(foreign, 65534, 65534)
    else:
        foreign = tmp_path.anchor        # "/": root's, and we are not root
    r = serve_fails(str(foreign))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ternlm: error: cache directory") and "belongs to uid" in last


def test_our_cache_dir_readable_by_others_is_tightened(tmp_path):
    from ternlm.kv.disk import DiskTier
    d = tmp_path / "kv"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    DiskTier(d, 1 << 20)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_cors_for_the_listed_origin_only(keyed):
    server, _ = keyed
    url = server.v1 + "/chat/completions"
    pre = httpx.options(url, headers={"Origin": WEB_APP, "Access-Control-Request-Method": "POST",
                                      "Access-Control-Request-Headers": "authorization, content-type"}, timeout=30)
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == WEB_APP
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    body = {"model": "smollm2-135m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    auth = {"Authorization": f"Bearer {ALICE}", "Origin": WEB_APP}
    ok = httpx.post(url, json=body, headers=auth, timeout=120)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == WEB_APP
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=auth, timeout=120) as r:
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == WEB_APP
        assert any("[DONE]" in line for line in r.iter_lines())
    err = httpx.post(url, json=body, headers={"Origin": WEB_APP}, timeout=30)          # no key: 401
    assert err.status_code == 401 and err.headers["access-control-allow-origin"] == WEB_APP
    assert err.json()["error"]["code"] == "invalid_api_key"
    other = httpx.post(url, json=body, headers={**auth, "Origin": "http://evil.example.test"}, timeout=120)
    assert "access-control-allow-origin" not in other.headers
    bad = httpx.options(url, headers={"Origin": "http://evil.example.test", "Access-Control-Request-Method": "POST"},
                        timeout=30)
    assert "access-control-allow-origin" not in bad.headers
