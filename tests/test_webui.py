#!/usr/bin/env python3
"""The web page `sluice serve` serves at / (api/webui.c, api/webui/), over
HTTP and in a real browser: headless Chromium driven by Selenium against the
real server on the default model, with --api-key.

Over HTTP (always): the files served are the repository's, with a
Content-Security-Policy that forbids inline scripts and nosniff; the page's
markup has no inline script, handler or style for that policy to block;
--no-web-ui takes the page away.

In the browser (when chromium, chromedriver and selenium are installed; else
printed as skipped): the key is asked for once and kept; a chat streams in
and ends with the text the API gives for the same request; Stop aborts a
reply mid-stream and /metrics goes back to nothing running and no KV held;
markup in a reply (an <img onerror>, a <script>) shows as text and never
runs; a JSONL file dropped on the page becomes a batch whose progress reaches
100%, and the output downloaded from the page is the Batch API's own;
cancelling works; the status panel shows the server.

Screenshots of each screen go to /tmp/sluice-webui/ (not committed).
Prints one line per test and ends with "N passed, N failed[, N skipped]".
"""
import base64
import html.parser
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(__file__))
import sluice_testlib as lib  # noqa: E402

KEY = "sk-webui-test"
NAME = "smol"
ROOT = lib.ROOT
SHOTS = "/tmp/sluice-webui"
TMP = tempfile.mkdtemp(prefix="sluice-test-webui-")
DOWNLOADS = os.path.join(TMP, "downloads")


# ---- HTTP helpers --------------------------------------------------------------------------------

def request(port, method, path, body=None, headers=None, key=KEY):
    """(status, headers dict with lower-case names, body bytes)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    h = dict(headers or {})
    if key:
        h["Authorization"] = f"Bearer {key}"
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
        h["Content-Type"] = "application/json"
    try:
        c.request(method, path, body=body, headers=h)
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        c.close()


def metrics(port):
    return lib.parse_metrics(request(port, "GET", "/metrics", key=None)[2].decode())


def repo_file(name):
    with open(os.path.join(ROOT, "api", "webui", name), "rb") as f:
        return f.read()


class Markup(html.parser.HTMLParser):
    """What of the page's markup a strict CSP would block: scripts without
    src, on* handlers, style attributes and <style> blocks, javascript: URLs."""

    def __init__(self):
        super().__init__()
        self.blocked, self.scripts, self.in_script = [], [], False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "script":
            self.scripts.append(a.get("src"))
            if not a.get("src"):
                self.blocked.append("inline <script>")
        if tag == "style":
            self.blocked.append("<style> block")
        for k, v in attrs:
            if k.startswith("on"):
                self.blocked.append(f"<{tag} {k}>")
            if k == "style":
                self.blocked.append(f"<{tag} style=>")
            if k in ("href", "src", "action") and v and v.strip().lower().startswith("javascript:"):
                self.blocked.append(f"<{tag} {k}=javascript:>")


# ---- HTTP tests (no browser needed) --------------------------------------------------------------

def test_files_and_headers(port):
    files = {"/": ("index.html", "text/html"), "/webui/app.js": ("app.js", "text/javascript"),
             "/webui/style.css": ("style.css", "text/css"), "/webui/favicon.svg": ("favicon.svg", "image/svg+xml")}
    for path, (name, ctype) in files.items():
        st, h, body = request(port, "GET", path, key=None)  # the page itself needs no key
        assert st == 200, (path, st)
        assert body == repo_file(name), f"{path} is not api/webui/{name} as built"
        assert h["content-type"].startswith(ctype), (path, h["content-type"])
        assert h["x-content-type-options"] == "nosniff", path
        csp = [d.strip() for d in h["content-security-policy"].split(";")]
        assert "script-src 'self'" in csp, csp
        assert not any("unsafe" in d for d in csp), csp
        # HEAD: a GET's length, no body; a revalidation by ETag: 304
        st, hh, b = request(port, "HEAD", path, key=None)
        assert st == 200 and b == b"" and int(hh["content-length"]) == len(body), (path, st, hh)
        st, _, b = request(port, "GET", path, headers={"If-None-Match": h["etag"]}, key=None)
        assert st == 304 and b == b"", (path, st)
    st, h, _ = request(port, "POST", "/", body={"x": 1}, key=None)
    assert st == 405 and h["allow"] == "GET, HEAD", (st, h)
    assert request(port, "GET", "/webui/nothing.js", key=None)[0] == 404


def test_markup_has_nothing_the_policy_blocks(port):
    p = Markup()
    p.feed(request(port, "GET", "/", key=None)[2].decode())
    assert p.blocked == [], p.blocked
    assert p.scripts == ["/webui/app.js"], p.scripts
    js = repo_file("app.js").decode()
    # the renderer never hands text to the HTML parser
    for bad in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert bad not in js, bad


def test_server_info_metric(port):
    m = metrics(port)
    info = [k for k in m if k.startswith("sluice:server_info{")]
    assert len(info) == 1 and m[info[0]] == 1, info
    backend = lib.log_backend("test_webui.log")
    assert f'backend="{backend}"' in info[0], (info, backend)


def test_no_web_ui(_port):
    port = lib.free_port()
    with lib.log_file("test_webui_off.log") as log:
        proc = lib.start_server(["--port", str(port), "--served-model-name", NAME, "--no-web-ui", "--data-dir",
                                 os.path.join(TMP, "data-off"), "--max-model-len", "256",
                                 "--kv-cache-memory", "64M"], stdout=log)
        try:
            assert lib.wait_healthy(port, proc), "the server did not start"
            for path in ("/", "/webui/app.js"):
                st, _, body = request(port, "GET", path, key=None)
                assert st == 404 and b"no route" in body, (path, st, body)
        finally:
            lib.stop_server(proc)


HTTP_TESTS = [test_files_and_headers, test_markup_has_nothing_the_policy_blocks, test_server_info_metric,
              test_no_web_ui]


# ---- the browser ---------------------------------------------------------------------------------

def browser_missing():
    """Why the browser tests cannot run here (None when they can)."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "no selenium (tools/setup.sh installs it)"
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        return "no chromium (tools/setup.sh installs it)"
    if not (shutil.which("chromedriver") or os.path.exists("/usr/lib/chromium/chromedriver")):
        return "no chromedriver (tools/setup.sh installs chromium-driver)"
    return None


def start_browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
              "--disable-extensions", "--disable-background-networking", "--window-size=1280,860",
              "--disable-renderer-backgrounding", "--disable-background-timer-throttling"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # the driver is named: Selenium would otherwise look for one to download
    driver = shutil.which("chromedriver") or "/usr/lib/chromium/chromedriver"
    d = webdriver.Chrome(service=Service(executable_path=driver), options=opts)
    os.makedirs(DOWNLOADS, exist_ok=True)
    d.execute_cdp_cmd("Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": DOWNLOADS})
    d.set_script_timeout(30)
    return d


def wait_for(what, fn, timeout=30, interval=0.05):
    """fn()'s first truthy value; AssertionError naming what after timeout."""
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        try:
            v = fn()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 (the page is mid-render: try again)
            last = e
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}" + (f" (last error: {last!r})" if last else ""))


def shot(d, name):
    d.save_screenshot(os.path.join(SHOTS, f"{name}.png"))


class Page:
    """The page in the browser, and the server it talks to."""

    def __init__(self, driver, port):
        self.d, self.port = driver, port
        self.url = f"http://127.0.0.1:{port}/"

    def js(self, script, *args):
        return self.d.execute_script(script, *args)

    def q(self, css):
        from selenium.webdriver.common.by import By
        return self.d.find_element(By.CSS_SELECTOR, css)

    def qs(self, css):
        from selenium.webdriver.common.by import By
        return self.d.find_elements(By.CSS_SELECTOR, css)

    def tab(self, name):
        self.q(f"#tab-{name}").click()
        wait_for(f"the {name} view", lambda: self.q(f"#view-{name}").is_displayed())

    def set_field(self, css, value):
        e = self.q(css)
        e.clear()
        e.send_keys(str(value))
        self.js("arguments[0].dispatchEvent(new Event('change'))", e)

    def chat_settings(self, temperature, max_tokens):
        if not self.js("return document.getElementById('settings').open"):
            self.q("#settings summary").click()
        self.set_field("#temperature", temperature)
        self.set_field("#max-tokens", max_tokens)

    def conversations(self):
        return json.loads(self.js("return localStorage.getItem('sluice.conversations')") or "[]")

    def current(self):
        cur = self.js("return localStorage.getItem('sluice.current')")
        return next(c for c in self.conversations() if c["id"] == cur)

    def models(self):
        return self.js("return [...document.querySelectorAll('#model option')].map(o => o.value)")

    def streaming(self):
        return self.js("return document.body.classList.contains('is-streaming')")


def test_api_key_asked_once_and_kept(p):
    p.d.get(p.url)
    # /v1/models answers 401 without the key: the page asks for it
    wait_for("the key dialog", lambda: p.q("#key-dialog").is_displayed())
    assert "API key" in p.q("#key-why").text, p.q("#key-why").text
    shot(p.d, "1-api-key")
    p.q("#key-input").send_keys(KEY)
    p.q("#key-save").click()
    wait_for("the model list", lambda: p.models() == [NAME])
    assert p.js("return localStorage.getItem('sluice.apiKey')") == KEY
    p.d.refresh()  # kept: no question the second time
    wait_for("the model list after a reload", lambda: p.models() == [NAME])
    assert not p.q("#key-dialog").is_displayed()


def test_chat_streams(p):
    p.chat_settings(0, 16)
    # every length the reply's text takes on, recorded in the page as it changes
    p.js("""window.__lengths = [];
        new MutationObserver(() => {
          const c = document.querySelector('#messages .msg.assistant:last-of-type .content');
          const n = c ? c.textContent.length : 0;
          if (n && window.__lengths[window.__lengths.length - 1] !== n) window.__lengths.push(n);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});""")
    prompt = "What is the capital of France?"
    system = "Answer in one short sentence."
    p.q("#system").send_keys(system)
    p.q("#prompt").send_keys(prompt + "\n")
    wait_for("the reply to start", p.streaming, timeout=10)
    wait_for("the reply to end", lambda: not p.streaming(), timeout=60)
    conv = p.current()
    reply = conv["messages"][-1]
    assert reply["role"] == "assistant" and not reply.get("error"), reply
    lengths = p.js("return window.__lengths")
    assert lengths and lengths == sorted(lengths), f"text lengths {lengths}"
    # the page read the reply as a stream, and drew it as it came: on the CPU
    # its tokens take longer than a few frames (a GPU may be done in one)
    assert reply["stats"]["chunks"] > 1, reply["stats"]
    if lib.log_backend("test_webui.log") in (None, "cpu"):
        assert len(lengths) >= 3, f"not drawn as it streamed: text lengths {lengths}"
    # the text the page assembled is what the API answers to the same request
    st, _, body = request(p.port, "POST", "/v1/chat/completions",
                          {"model": NAME, "messages": [{"role": "system", "content": system},
                                                       {"role": "user", "content": prompt}],
                           "temperature": 0, "max_tokens": 16})
    assert st == 200, body
    api = json.loads(body)
    assert reply["content"] == api["choices"][0]["message"]["content"], (reply["content"], api)
    s = reply["stats"]
    assert s["completion_tokens"] == api["usage"]["completion_tokens"], (s, api["usage"])
    assert s["prompt_tokens"] == api["usage"]["prompt_tokens"], (s, api["usage"])
    assert s["ttft_ms"] > 0 and s.get("tok_s", 0) > 0, s
    stats = p.q("#messages .msg.assistant:last-of-type .stats").text
    assert f"completion {s['completion_tokens']}" in stats and "TTFT" in stats and "tok/s" in stats, stats
    assert conv["title"].startswith("What is the capital") and conv["system"] == system, conv
    shot(p.d, "2-chat")
    # Copy puts the reply's text, as the model wrote it, on the clipboard
    p.d.execute_cdp_cmd("Browser.grantPermissions", {"origin": p.url.rstrip("/"),
                                                     "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]})
    p.js("document.querySelector('#messages .msg.assistant:last-of-type .actions button').click()")
    wait_for("the copy", lambda: p.d.execute_async_script(
        "navigator.clipboard.readText().then(arguments[0], () => arguments[0](null))") == reply["content"], timeout=5)


def test_stop_aborts_the_request(p):
    p.q("#new-chat").click()
    p.chat_settings(0, 1500)
    p.q("#prompt").send_keys("Write a very long story about a dragon who learns to fly, in twenty chapters.\n")
    wait_for("text to stream in",
             lambda: len(p.q("#messages .msg.assistant:last-of-type .content").text) > 20, timeout=60)
    m = metrics(p.port)
    assert m["sluice:num_requests_running"] == 1 and m["sluice:kv_blocks_used"] > 0, m
    assert p.streaming(), "the reply ended before Stop (1500 tokens asked)"
    shot(p.d, "3-chat-streaming")
    p.q("#stop").click()
    wait_for("the page to stop streaming", lambda: not p.streaming(), timeout=5)
    # the closed stream ends the request in the engine and frees its KV, long
    # before 1500 tokens could have run
    wait_for("/metrics to show nothing running", lambda: (lambda m: m["sluice:num_requests_running"] == 0 and
             m["sluice:num_requests_waiting"] == 0 and m["sluice:kv_blocks_used"] == 0)(metrics(p.port)),
             timeout=20, interval=0.2)
    reply = p.current()["messages"][-1]
    assert reply.get("stopped") and reply["content"], reply
    assert "stopped" in p.q("#messages .msg.assistant:last-of-type .stats").text
    shot(p.d, "4-chat-stopped")
    # regenerate: the last reply again, from the same conversation
    p.chat_settings(0, 6)
    p.js("document.querySelector('#messages .msg.assistant:last-of-type .regenerate').click()")
    wait_for("the regenerated reply", lambda: not p.streaming() and p.current()["messages"][-1].get("stats"),
             timeout=60)
    again = p.current()["messages"]
    assert len(again) == 2 and again[-1]["role"] == "assistant" and not again[-1].get("stopped"), again
    assert reply["content"].startswith(again[-1]["content"][:10]), (reply["content"][:40], again[-1]["content"])
    shot(p.d, "5-chat-regenerated")


# What a model might say that a browser would run, were it handed to the HTML parser.
HOSTILE = ("Look: <img src=x onerror=alert(1)> and <script>window.__pwned = 1</script>\n\n"
           "**bold** and [a link](javascript:alert(2)) and `<b>code</b>`\n\n"
           "```html\n<script>window.__pwned = 3</script>\n<img src=x onerror=\"window.__pwned = 4\">\n```\n")


def test_markup_renders_as_text(p):
    conv = {"id": "hostile", "title": "<img src=x onerror=alert(5)>", "system": "",
            "messages": [{"role": "user", "content": "<script>window.__pwned = 6</script>"},
                         {"role": "assistant", "content": HOSTILE, "reasoning": "<img src=x onerror=alert(7)>",
                          "stats": {"completion_tokens": 3},
                          "streaming": True}], "updated": 0}  # kept mid-reply: shown as stopped
    p.js("localStorage.setItem('sluice.conversations', JSON.stringify([arguments[0]].concat("
         "JSON.parse(localStorage.getItem('sluice.conversations') || '[]'))));"
         "localStorage.setItem('sluice.current', 'hostile');", conv)
    p.d.refresh()
    wait_for("the seeded conversation", lambda: len(p.qs("#messages .msg")) == 2)
    p.q("#messages .msg.assistant .reasoning summary").click()  # unfolded: its text is in the page too
    time.sleep(0.3)
    from selenium.common.exceptions import NoAlertPresentException
    try:
        alert = p.d.switch_to.alert
        raise AssertionError(f"an alert ran: {alert.text}")
    except NoAlertPresentException:
        pass
    assert p.js("return window.__pwned") is None
    found = p.js("return [...document.querySelectorAll('#messages img, #messages script, #messages b, "
                 "#conv-list img, a[href^=\"javascript\"]')].map(e => e.outerHTML)")
    assert found == [], found
    text = p.q("#messages").text
    for s in ("<img src=x onerror=alert(1)>", "<script>window.__pwned = 1</script>", "<b>code</b>",
              "<script>window.__pwned = 6</script>", "<img src=x onerror=alert(7)>",
              "<img src=x onerror=\"window.__pwned = 4\">", "[a link](javascript:alert(2))"):
        assert s in text, (s, text)
    # Markdown itself still renders: bold, inline code, a code block
    assert p.q("#messages .msg.assistant strong").text == "bold"
    assert p.q("#messages .msg.assistant .code pre code").text.startswith("<script>")
    assert "<img src=x onerror=alert(5)>" in p.q("#conv-list").text
    assert "stopped" in p.q("#messages .msg.assistant .stats").text
    shot(p.d, "6-markup-as-text")


def batch_lines(max_tokens):
    """A batch file: one chat request per entry of max_tokens."""
    return "".join(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": NAME, "temperature": 0, "max_tokens": m, "ignore_eos": True,
                                        "messages": [{"role": "user", "content": f"Count from {i} to {i + 5}."}]}})
                   + "\n" for i, m in enumerate(max_tokens))


def drop_file(p, name, text):
    """A file dropped on the drop zone, as a drag from the desktop delivers it."""
    p.js("""const dt = new DataTransfer();
        dt.items.add(new File([arguments[1]], arguments[0], {type: 'application/jsonl'}));
        const zone = document.getElementById('drop');
        zone.dispatchEvent(new DragEvent('dragover', {dataTransfer: dt, bubbles: true, cancelable: true}));
        zone.dispatchEvent(new DragEvent('drop', {dataTransfer: dt, bubbles: true, cancelable: true}));""",
         name, text)


def newest_batch(p):
    st, _, body = request(p.port, "GET", "/v1/batches?limit=1")
    assert st == 200, body
    return json.loads(body)["data"][0]


def test_batch_upload_progress_download(p):
    p.tab("batches")
    n = 4
    # and one request the server refuses: a failed row, in the error file
    bad = json.dumps({"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": NAME, "messages": 5}}) + "\n"
    drop_file(p, "webui-test.jsonl", batch_lines([6] * n) + bad)
    wait_for("the upload", lambda: p.q("#batch-create").is_enabled(), timeout=20)
    assert f"{n + 1} requests" in p.q("#upload-info").text, p.q("#upload-info").text
    p.q("#batch-create").click()
    bid = wait_for("the batch in the list", lambda: p.q("#batch-table tbody tr").get_attribute("data-batch"))
    assert bid == newest_batch(p)["id"]
    row = f"#batch-table tr[data-batch='{bid}']"
    seen = set()

    def progress():
        # the status first: a bar read after it shows that render or a later one, so the poll that sees
        # "completed" also records the bar's 100 (a batch may finish between two polls)
        done = p.q(row).get_attribute("data-status") == "completed"
        seen.add(int(p.q(f"{row} [role=progressbar]").get_attribute("aria-valuenow")))
        return done
    wait_for("the batch to complete in the list", progress, timeout=90, interval=0.2)
    assert int(p.q(f"{row} [role=progressbar]").get_attribute("aria-valuenow")) == 100
    assert f"{n + 1} / {n + 1} (1 failed)" in p.q(row).text, p.q(row).text
    assert max(seen) == 100, seen
    shot(p.d, "7-batch-completed")
    # the files as the page downloads them are the Batch API's own
    b = newest_batch(p)
    assert b["status"] == "completed" and b["request_counts"] == {"total": n + 1, "completed": n, "failed": 1}, b
    got = {}
    for key, suffix in (("output_file_id", "output"), ("error_file_id", "errors")):
        p.q(f"{row} button[data-file='{b[key]}']").click()
        path = os.path.join(DOWNLOADS, f"{bid}_{suffix}.jsonl")
        wait_for(f"the {suffix} download", lambda: os.path.exists(path) and not os.path.exists(path + ".crdownload"),
                 timeout=20)
        time.sleep(0.2)
        with open(path, "rb") as f:
            got[key] = f.read()
        st, _, want = request(p.port, "GET", f"/v1/files/{b[key]}/content")
        assert st == 200 and got[key] == want, (key, len(got[key]), len(want))
    ids = sorted(json.loads(line)["custom_id"] for line in got["output_file_id"].decode().splitlines())
    assert ids == sorted(f"req-{i}" for i in range(n)), ids
    errs = [json.loads(line) for line in got["error_file_id"].decode().splitlines()]
    assert [e["custom_id"] for e in errs] == ["bad"], errs


def test_batch_cancel(p):
    # a few short requests, then long ones: the batch shows a rate and an ETA, then is cancelled
    drop_file(p, "webui-cancel.jsonl", batch_lines([4] * 4 + [300] * 30))
    wait_for("the upload", lambda: p.q("#batch-create").is_enabled(), timeout=20)
    p.q("#batch-create").click()
    bid = wait_for("the new batch", lambda: (lambda r: r.get_attribute("data-batch") if r.get_attribute(
        "data-status") in ("validating", "in_progress") else None)(p.q("#batch-table tbody tr")), timeout=20)
    row = f"#batch-table tr[data-batch='{bid}']"
    rate = wait_for("a rate and an ETA", lambda: (lambda c: c if "req/s" in c[3].text and ":" in c[4].text else None)(
        p.qs(f"{row} td")), timeout=30, interval=0.2)
    assert float(rate[3].text.split()[0]) > 0, rate[3].text
    shot(p.d, "8-batch-running")
    cancel = wait_for("its Cancel button", lambda: [e for e in p.qs(f"{row} button") if e.text == "Cancel"])
    cancel[0].click()  # the same button across the list's refreshes (else this click would find it stale)
    wait_for("the batch to be cancelled", lambda: p.q(f"#batch-table tr[data-batch='{bid}']").get_attribute(
        "data-status") == "cancelled", timeout=60, interval=0.2)
    st, _, body = request(p.port, "GET", f"/v1/batches/{bid}")
    assert json.loads(body)["status"] == "cancelled", body
    wait_for("nothing running after the cancel", lambda: metrics(p.port)["sluice:num_requests_running"] == 0,
             timeout=30, interval=0.2)


def test_status_panel(p):
    p.tab("server")
    stat = """const s = [...document.querySelectorAll('#srv-grid .stat')]
        .find(e => e.querySelector('.stat-label').textContent === arguments[0]);
        return s ? s.querySelector('.stat-value').textContent + ' | ' + (s.querySelector('.small') || {}).textContent
                 : null;"""
    wait_for("the status panel", lambda: NAME in (p.js(stat, "Model") or ""), timeout=10)
    # the live decode rate needs two samples: the panel refreshes by itself
    wait_for("a second refresh", lambda: "tok/s" in p.js(stat, "Decode"), timeout=10)
    backend = lib.log_backend("test_webui.log")
    assert p.js(stat, "Backend").startswith(backend), p.js(stat, "Backend")
    assert p.js(stat, "Requests").startswith("0 running"), p.js(stat, "Requests")
    m = metrics(p.port)
    kv = p.js(stat, "KV cache")
    assert f"/ {int(m['sluice:kv_blocks_total']):,} blocks" in kv, (kv, m["sluice:kv_blocks_total"])
    assert p.js(stat, "Health").startswith("ok"), p.js(stat, "Health")
    shot(p.d, "9-server")


def test_no_console_errors(p):
    errors = [e["message"] for e in p.d.get_log("browser") if e["level"] == "SEVERE"]
    # the 401s the key question started from are the server's answer, not the page's fault
    errors = [e for e in errors if "status of 401" not in e]
    assert errors == [], errors


BROWSER_TESTS = [test_api_key_asked_once_and_kept, test_chat_streams, test_stop_aborts_the_request,
                 test_markup_renders_as_text, test_batch_upload_progress_download, test_batch_cancel,
                 test_status_panel, test_no_console_errors]


def main():
    if lib.missing_prereqs("test_webui"):
        return 1
    only = sys.argv[1:]
    port = lib.free_port()
    log = lib.log_file("test_webui.log")
    proc = lib.start_server(["--port", str(port), "--served-model-name", NAME, "--api-key", KEY, "--data-dir",
                             os.path.join(TMP, "data"), "--max-model-len", "2048", "--max-num-seqs", "16",
                             "--kv-cache-memory", "256M", "--enable-prompt-tokens-details",
                             # one thread: on a loaded 2-core machine two OpenMP threads wait on each
                             # other (measured 16x slower decode); the page, not the speed, is tested
                             "--threads", "1"], stdout=log)
    passed = failed = skipped = 0
    driver = None
    try:
        if not lib.wait_healthy(port, proc):
            print("FAIL the server did not start (build/test_webui.log)")
            return lib.summary(0, 1)
        passed, failed = lib.run_tests(HTTP_TESTS, port, proc=proc, only=only)
        why = browser_missing()
        if why:
            skipped = len([t for t in BROWSER_TESTS if not only or t.__name__ in only])
            print(f"skip {skipped} browser tests: {why}", flush=True)
        else:
            shutil.rmtree(SHOTS, ignore_errors=True)
            os.makedirs(SHOTS)
            try:
                driver = start_browser()
            except Exception as e:  # noqa: BLE001 (a browser that will not start is a failure, said plainly)
                print(f"FAIL the browser did not start: {e}", flush=True)
                failed += 1
            if driver:
                p2, f2 = lib.run_tests(BROWSER_TESTS, Page(driver, port), proc=proc, only=only)
                passed, failed = passed + p2, failed + f2
                print(f"     screenshots in {SHOTS}/", flush=True)
    finally:
        if driver:
            driver.quit()
        lib.stop_server(proc)
        log.close()
        shutil.rmtree(TMP, ignore_errors=True)
    print(f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
