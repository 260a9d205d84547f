"""The chat page served at `/`, driven in headless Chromium (Debian's /usr/bin/chromium) by Playwright.

One real `ternlm serve` process (smollm2-135m, float32, 2 slots, an API key) serves the page and the
API; the browser talks to it exactly as a user's would. What is checked:
- two turns: the streamed answer appears and the second turn's line reports reused tokens > 0;
  reopening the saved chat from the sidebar and continuing reuses the whole previous prompt;
  editing the first message truncates after it and the line shows that less was reused;
- Stop: the stream ends, /slots shows every slot free, the next message works;
- model output is text: a crafted SSE answer (a Playwright route, standing in for the server) carrying
  <img onerror> and <script> renders literally, fires no dialog and runs nothing;
- a failed request is shown with a Retry that resends the same transcript;
- two tabs keep each other's conversations in localStorage;
- the API key prompt on a 401, the key kept in sessionStorage only;
- the static route: CSP + nosniff headers, only allowlisted names, no path traversal.
A screenshot after two turns is saved to artifacts/ui-two-turns.png.

Never `playwright install` (it downloads a browser): Chromium comes from apt (`apt-get install chromium`).
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from server_proc import ServerProc

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
KEY = "sk-ui-test-key"
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
TURN_MS = 120_000        # one short answer on a busy 2-core machine, with generous headroom
STATS = re.compile(r"^reused (\d+) / (\d+) tokens · first token \d+\.\d\d s · \d+(\.\d)? tok/s")

@pytest.fixture(scope="module")
def server():
    srv = ServerProc("-m", "smollm2-135m", "--dtype", "float32", "--slots", "2", "--api-key", KEY).start()
    try:
        yield srv.wait_ready()
    finally:
        srv.close()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (never `playwright install`)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def keyed_context(browser, **kw):
    """A fresh profile (empty storage) whose tab already holds the API key, as after the prompt."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 800}, color_scheme="light", **kw)
    ctx.add_init_script(f"sessionStorage.setItem('ternlm.apiKey', {json.dumps(KEY)})")
    return ctx


@pytest.fixture
def context(browser):
    ctx = keyed_context(browser)
    yield ctx
    ctx.close()


def open_page(context, server, query: str = "?max_tokens=24&temperature=0"):
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(server.base + "/" + query)
    page.wait_for_selector("#model-name:has-text('smollm2-135m')", timeout=30_000)
    return page, errors


def send(page, text: str) -> dict:
    """Type `text` (Shift+Enter between lines), press Enter, wait for the answer's stats line; returns
    the answer's text and numbers."""
    before = page.locator(".msg.assistant").count()
    first, *rest = text.split("\n")
    page.fill("#input", first)
    for line in rest:
        page.press("#input", "Shift+Enter")
        page.locator("#input").press_sequentially(line)
    page.press("#input", "Enter")
    answer = page.locator(".msg.assistant").nth(before)
    answer.locator(".stats:not(:empty)").wait_for(timeout=TURN_MS)
    return answer_info(answer)


def answer_info(answer) -> dict:
    stats = answer.locator(".stats")
    return {"text": answer.locator(".md").inner_text(), "stats": stats.inner_text(),
            "state": answer.get_attribute("data-state"),
            "cached": int(stats.get_attribute("data-cached") or -1),
            "prompt": int(stats.get_attribute("data-prompt") or -1)}


def slots(server) -> list[dict]:
    r = httpx.get(server.base + "/slots", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    r.raise_for_status()
    return r.json()["slots"]


# ---- the static route ----------------------------------------------------------------------------

def test_page_headers_and_allowlist(server):
    r = httpx.get(server.base + "/", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    for directive in ("default-src 'self'", "script-src 'self'", "style-src 'self'", "connect-src 'self'",
                      "base-uri 'none'", "frame-ancestors 'none'", "form-action 'none'"):
        assert directive in csp
    assert "unsafe-inline" not in csp and "http" not in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    assert "<script type=\"module\" src=\"/static/app.js\"></script>" in r.text
    assert not re.search(r"<script(?![^>]*\bsrc=)", r.text), "inline script in index.html"
    js = ["app.js", "api.js", "markdown.js", "stats.js", "store.js"]
    for name, kind in [*((n, "text/javascript") for n in js), ("style.css", "text/css"), ("favicon.svg", "image/svg")]:
        r = httpx.get(f"{server.base}/static/{name}", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), name
        assert r.headers["x-content-type-options"] == "nosniff"
    for bad in ["ui.py", "..%2Fui.py", "..%2F..%2Fapp.py", "%2e%2e", ".", "", "app.js%00", "../app.py",
                "static/app.js", "%2Fetc%2Fpasswd"]:
        r = httpx.get(f"{server.base}/static/{bad}", timeout=10)
        assert r.status_code == 404, (bad, r.status_code, r.text[:200])
        assert "import" not in r.text
    # the page is public (it holds nothing secret); the API behind it is not
    assert httpx.get(server.base + "/v1/models", timeout=10).status_code == 401


# ---- real conversations --------------------------------------------------------------------------

def test_two_turns_reuse_screenshot_reopen_and_edit(context, server):
    page, errors = open_page(context, server)
    first = send(page, "What is the capital of France?")
    assert first["text"].strip() and first["state"] == "done"
    assert STATS.match(first["stats"]), first["stats"]
    second = send(page, "And what is the capital of Germany?")
    assert second["text"].strip()
    assert STATS.match(second["stats"]), second["stats"]
    assert second["cached"] > 0, second
    assert second["prompt"] > first["prompt"]
    assert page.locator(".msg").count() == 4
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "ui-two-turns.png"))

    # saved in localStorage, listed in the sidebar; reopening it and continuing resends the whole
    # transcript, so the server's KV for it (still in its slot) covers the whole previous prompt
    page.click("#new-chat")
    assert page.locator(".msg").count() == 0
    page.reload()
    page.wait_for_selector("#model-name:has-text('smollm2-135m')")
    row = page.locator(".conv", has_text="What is the capital of France?")
    assert row.count() == 1 and "2 turns" in row.inner_text()
    row.locator(".conv-open").click()
    assert page.locator(".msg").count() == 4
    assert page.locator(".msg.assistant .md").nth(1).inner_text() == second["text"]
    third = send(page, "Thank you!")
    assert third["cached"] >= second["prompt"], (third, second)

    # edit the first question: everything after it goes, and the line says less was reused
    page.locator(".msg.user").first.hover()
    page.locator(".msg.user").first.locator("button.edit").click()
    page.fill(".editor textarea", "What is the capital of Spain?")
    page.locator(".editor button.primary").click()
    page.locator(".msg.assistant").first.locator(".stats:not(:empty)").wait_for(timeout=TURN_MS)
    assert page.locator(".msg").count() == 2
    assert page.locator(".msg.user .bubble").first.inner_text() == "What is the capital of Spain?"
    edited = answer_info(page.locator(".msg.assistant").first)
    assert "resent after an edit" in edited["stats"]
    assert 0 <= edited["cached"] < edited["prompt"] and edited["cached"] < third["cached"], edited
    assert STATS.match(edited["stats"]), edited["stats"]
    assert not errors, errors


def test_stop_frees_the_slot_and_the_next_message_works(context, server):
    page, errors = open_page(context, server, "?max_tokens=2000&temperature=0")
    page.fill("#input", "Count from 1 to 1000, separated by commas.")
    page.press("#input", "Enter")
    answer = page.locator(".msg.assistant").first
    answer.locator(".md p").first.wait_for(timeout=TURN_MS)   # the first streamed text is on screen
    assert page.locator("#stop").is_visible()
    assert any(s["busy"] for s in slots(server))
    page.click("#stop")
    answer.locator(".stats:not(:empty)").wait_for(timeout=10_000)
    info = answer_info(answer)
    assert info["state"] == "stopped" and info["stats"].startswith("stopped"), info
    saved = page.evaluate("() => Object.values(JSON.parse(localStorage.getItem('ternlm.chats.v1')))")
    assert saved[0]["messages"][1]["content"], saved      # the partial answer is kept in the transcript
    assert page.locator("#send").is_visible() and not page.locator("#stop").is_visible()

    deadline = time.monotonic() + 10
    while any(s["busy"] for s in slots(server)):
        assert time.monotonic() < deadline, f"a slot is still busy 10 s after Stop: {slots(server)}"
        time.sleep(0.2)

    # the next message works (max tokens lowered through the settings panel)
    page.click("#settings summary")
    page.fill("#set-max-tokens", "16")
    page.locator("#set-max-tokens").dispatch_event("change")
    nxt = send(page, "Thanks, that is enough.")
    assert nxt["state"] == "done" and nxt["text"].strip()
    assert nxt["cached"] > 0, nxt          # the stopped turn's KV (prompt + what was streamed) is reused
    assert not errors, errors


# ---- model output cannot inject markup ------------------------------------------------------------

PAYLOAD = ("Look: <img src=x onerror=alert(1)> and <script>alert(2)</script>\n\n"
           "- **<img src=y onerror=alert(3)>** in a list\n"
           "- `<script>alert(4)</script>` as code\n\n"
           "```html\n<img src=z onerror=alert(5)><script>alert(6)</script>\n```\n\n"
           "[click](javascript:alert(7)) <svg onload=alert(8)></svg> <iframe src=\"javascript:alert(9)\"></iframe>\n"
           "<img src=q onerror=\"window.__pwned=1\">")


def _sse(chunks: list[dict]) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def crafted_stream(text: str, with_numbers: bool) -> str:
    """What the server would stream for `text`, cut into 5-character deltas."""
    base = {"id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 0, "model": "smollm2-135m"}
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None}]}]
    chunks += [{**base, "choices": [{"index": 0, "delta": {"content": text[i:i + 5]}, "finish_reason": None}]}
               for i in range(0, len(text), 5)]
    timings = {"prompt_n": 31, "cache_n": 2034, "prompt_ms": 70.0, "predicted_n": 48, "predicted_ms": 1000.0,
               "predicted_per_second": 48.0}
    end = {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    chunks.append({**end, "timings": timings} if with_numbers else end)
    if with_numbers:
        chunks.append({**base, "choices": [], "timings": timings,
                       "usage": {"prompt_tokens": 2065, "completion_tokens": 48, "total_tokens": 2113,
                                 "prompt_tokens_details": {"cached_tokens": 2034}}})
    return _sse(chunks)


@pytest.mark.parametrize("csp", [True, False], ids=["with-csp", "renderer-alone"])
def test_model_output_is_rendered_as_text(browser, server, csp):
    """With the CSP, and without it (bypass_csp): the renderer alone must keep markup inert; the CSP
    is the second wall (with it, even an inline handler that got into the DOM could not run)."""
    context = keyed_context(browser, bypass_csp=not csp)
    try:
        _check_rendered_as_text(context, server, csp)
    finally:
        context.close()


def _check_rendered_as_text(context, server, csp: bool):
    page, errors = open_page(context, server)
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    bodies: list[dict] = []

    def fake_server(route):
        bodies.append(json.loads(route.request.post_data))
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"},
                      body=crafted_stream(PAYLOAD, with_numbers=len(bodies) == 1))
    page.route("**/v1/chat/completions", fake_server)
    page.click("#system-box summary")
    page.fill("#system-prompt", "Be terse.")

    first = send(page, "Say something dangerous")
    assert first["stats"] == "reused 2034 / 2065 tokens · first token 0.07 s · 48 tok/s"
    second = send(page, "Again,\nwithout numbers")          # no usage/timings: measured in the browser
    assert re.match(r"^reuse not reported · first token \d+\.\d\d s", second["stats"]), second["stats"]
    page.wait_for_timeout(300)                                # give any injected handler a chance to run

    assert dialogs == []
    assert page.evaluate("window.__pwned === undefined")
    md = page.locator(".msg.assistant .md").first
    text = md.inner_text()
    for literal in ["<img src=x onerror=alert(1)>", "<script>alert(2)</script>", "<img src=y onerror=alert(3)>",
                    "<script>alert(4)</script>", "<img src=z onerror=alert(5)><script>alert(6)</script>",
                    "[click](javascript:alert(7))", "<svg onload=alert(8)></svg>",
                    '<img src=q onerror="window.__pwned=1">']:
        assert literal in text, literal
    for tag in ["img", "script", "svg", "iframe", "a"]:
        assert md.locator(tag).count() == 0, tag
    assert page.locator("#messages img, #messages script, #messages iframe, #messages svg").count() == 0
    # and the Markdown around it still rendered
    assert md.locator("strong").inner_text() == "<img src=y onerror=alert(3)>"
    assert md.locator("li code").inner_text() == "<script>alert(4)</script>"
    assert md.locator("pre code").inner_text().strip() == "<img src=z onerror=alert(5)><script>alert(6)</script>"
    # what the page sent: the whole transcript, streaming with usage, the settings from the URL
    assert bodies[1]["messages"] == [{"role": "system", "content": "Be terse."},
                                     {"role": "user", "content": "Say something dangerous"},
                                     {"role": "assistant", "content": PAYLOAD},
                                     {"role": "user", "content": "Again,\nwithout numbers"}]
    assert bodies[1]["stream"] is True and bodies[1]["stream_options"] == {"include_usage": True}
    assert bodies[1]["max_tokens"] == 24 and bodies[1]["temperature"] == 0
    assert bodies[0]["prompt_cache_key"] == bodies[1]["prompt_cache_key"]
    if csp:   # the browser enforces the header: a script element added to the DOM does not run
        assert page.evaluate("""() => { const s = document.createElement('script');
            s.textContent = 'window.__inline = 1'; document.body.append(s); return window.__inline; }""") is None
    assert not [e for e in errors if not (csp and "Content Security Policy" in e)], errors


def test_an_error_is_shown_and_retry_resends(context, server):
    page, errors = open_page(context, server)
    bodies: list[dict] = []

    def flaky(route):
        bodies.append(json.loads(route.request.post_data))
        if len(bodies) > 1:
            route.continue_()                                 # the real server answers the retry
            return
        error = {"message": "messages: too long for this test", "type": "invalid_request_error",
                 "param": "messages", "code": "context_length_exceeded"}
        route.fulfill(status=400, headers={"Content-Type": "application/json"}, body=json.dumps({"error": error}))
    page.route("**/v1/chat/completions", flaky)

    page.fill("#input", "Name a colour.")
    page.press("#input", "Enter")
    answer = page.locator(".msg.assistant").first
    answer.locator(".stats:not(:empty)").wait_for(timeout=10_000)
    assert answer.get_attribute("data-state") == "error"
    assert answer.locator(".stats").inner_text().startswith("error: messages: too long for this test")
    answer.locator("button.retry").click()
    page.locator(".msg.assistant .stats[data-cached]").wait_for(timeout=TURN_MS)
    assert page.locator(".msg").count() == 2 and page.locator(".msg.assistant").get_attribute("data-state") == "done"
    assert bodies[0]["messages"] == bodies[1]["messages"] == [{"role": "user", "content": "Name a colour."}]
    assert not [e for e in errors if "status of 400" not in e], errors


def test_two_tabs_keep_each_others_chats(context, server):
    """Each tab writes only its own conversation into localStorage and lists the other's."""
    context.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=crafted_stream("Fine.", True)))
    a, errors_a = open_page(context, server)
    b, errors_b = open_page(context, server)
    send(a, "Chat in tab A")
    send(b, "Chat in tab B")
    send(a, "More in tab A")
    chats = a.evaluate("() => Object.values(JSON.parse(localStorage.getItem('ternlm.chats.v1')))")
    assert sorted(c["messages"][0]["content"] for c in chats) == ["Chat in tab A", "Chat in tab B"]
    b.locator(".conv", has_text="Chat in tab A").wait_for(timeout=5_000)   # via the storage event
    assert "2 turns" in b.locator(".conv", has_text="Chat in tab A").inner_text()
    assert not errors_a + errors_b


# ---- API key ------------------------------------------------------------------------------------

def test_api_key_prompt_on_401(browser, server):
    ctx = browser.new_context()
    try:
        page = ctx.new_page()
        page.goto(server.base + "/")
        dialog = page.locator("#key-dialog")
        dialog.wait_for(state="visible", timeout=30_000)
        assert "requires an API key" in dialog.inner_text()
        page.fill("#key-input", "sk-wrong")
        page.press("#key-input", "Enter")
        page.wait_for_selector("#key-message:has-text('not accepted')", timeout=10_000)
        page.fill("#key-input", KEY)
        page.click("#key-save")
        page.wait_for_selector("#model-name:has-text('smollm2-135m')", timeout=10_000)
        assert not dialog.is_visible()
        assert page.evaluate("sessionStorage.getItem('ternlm.apiKey')") == KEY
        assert KEY not in page.evaluate("JSON.stringify(localStorage)")
        page.reload()                                         # asked once: the tab keeps the key
        page.wait_for_selector("#model-name:has-text('smollm2-135m')", timeout=10_000)
        assert not dialog.is_visible()
    finally:
        ctx.close()


def test_thinking_is_shown_apart_collapsed_and_never_resent(context, server):
    """A reasoning model's stream (reasoning_content deltas, then content): the page shows the thinking
    in a collapsed block above the answer with its token count, and resends only the answer."""
    page, errors = open_page(context, server)
    bodies: list[dict] = []
    base = {"id": "chatcmpl-think", "object": "chat.completion.chunk", "created": 0, "model": "smollm2-135m"}

    def fake_server(route):
        bodies.append(json.loads(route.request.post_data))
        thinking, answer = "First, the sky. <b>Then</b> the sea.", "It is **blue**."
        deltas = [{"reasoning_content": thinking[i:i + 6]} for i in range(0, len(thinking), 6)]
        deltas += [{"content": answer[i:i + 4]} for i in range(0, len(answer), 4)]
        chunks = [{**base, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
        chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        chunks.append({**base, "choices": [], "usage": {
            "prompt_tokens": 40, "completion_tokens": 20, "total_tokens": 60, "prompt_tokens_details": {"cached_tokens": 30},
            "completion_tokens_details": {"reasoning_tokens": 12}}})
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=_sse(chunks))
    page.route("**/v1/chat/completions", fake_server)

    first = send(page, "Why blue?")
    assert "thought 12 tok" in first["stats"]
    box = page.locator(".msg.assistant details.thinking").first
    assert box.locator("summary").inner_text() == "Thought (12 tokens)"
    assert not box.evaluate("d => d.open"), "collapsed once the answer is there"
    assert box.locator("div").text_content() == "First, the sky. <b>Then</b> the sea."     # text, not markup
    assert box.locator("b").count() == 0
    assert page.locator(".msg.assistant .md strong").first.inner_text() == "blue"
    send(page, "And?")
    assert bodies[1]["messages"][1] == {"role": "assistant", "content": "It is **blue**."}
    assert not errors, errors
