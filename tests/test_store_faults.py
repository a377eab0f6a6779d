#!/usr/bin/env python3
"""The batch store when things go wrong around it, against the real `sluice
serve` (and `sluice run-batch`) with the default model:

- a full disk: the data dir on a small tmpfs, filled while a batch runs.
  Result writes fail, results wait in memory (bounded), no new batch work is
  fed, /health and /metrics say the store is failing; once space returns the
  batch finishes with every row exactly once, each with a well-formed,
  distinct request_id (a use-after-free once wrote garbage ids here);
- a data dir that is not one (files but no database) is refused at start and
  nothing in it is touched;
- run-batch refuses a file whose custom_ids repeat, naming the lines.

The tmpfs is mounted in a private mount namespace (`unshare -rm`, no root
needed where user namespaces are allowed) that lives and dies with the
server, so a failed test never leaves a mount behind; the test reaches the
filesystem through /proc/PID/root. Where no namespace can be made the
disk-full test says so and is skipped.

Prints one line per test and ends with "N passed, N failed".
"""
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(__file__))
import sluice_testlib as lib  # noqa: E402
from sluice_testlib import BIN, MODEL, free_port  # noqa: E402

TMP = tempfile.mkdtemp(prefix="sluice-test-faults-")
KEY = "sk-faults"


def call(port, method, path, body=None, headers=None, timeout=60):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    h = {"Authorization": "Bearer " + KEY}
    h.update(headers or {})
    c.request(method, path, body=body, headers=h)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def upload(port, text):
    boundary = "sluiceboundary46"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
            f"Content-Type: application/jsonl\r\n\r\n{text}\r\n--{boundary}--\r\n").encode()
    st, data = call(port, "POST", "/v1/files", body, {"Content-Type": f"multipart/form-data; boundary={boundary}"})
    assert st == 200, (st, data)
    return json.loads(data)["id"]


def line(i, max_tokens=3):
    return json.dumps({"custom_id": f"df{i:04d}", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "smol", "messages": [{"role": "user", "content": f"Count to {i}."}],
                                "max_tokens": max_tokens, "temperature": 0}})


def fill(path):
    """Writes path until the filesystem is full; returns the bytes written."""
    n = 0
    with open(path, "wb", buffering=0) as f:
        chunk = b"\0" * (64 << 10)
        try:
            while True:
                n += f.write(chunk)
        except OSError:
            pass
    return n


def can_unshare():
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_disk_full():
    if not can_unshare():
        print("     skipped: no private mount namespace here (unshare -rm failed)", flush=True)
        return
    mnt = os.path.join(TMP, "mnt")
    os.makedirs(mnt)
    port = free_port()
    log = lib.log_file("test_store_faults_diskfull.log")
    # the tmpfs exists only inside the server's mount namespace
    proc = subprocess.Popen(
        ["unshare", "-rm", "--", "sh", "-c", 'mount -t tmpfs -o size=12m sluice-test-disk "$0" && exec "$@"', mnt,
         BIN, "serve", MODEL, "--port", str(port), "--served-model-name", "smol", "--api-key", KEY,
         "--max-model-len", "256", "--max-num-seqs", "4", "--kv-cache-memory", "128M", "--threads", "1",
         "--data-dir", os.path.join(mnt, "data")], stdout=log, stderr=subprocess.STDOUT)
    try:
        assert lib.wait_healthy(port, proc), "server did not start"
        inside = f"/proc/{proc.pid}/root{mnt}"
        assert os.path.isdir(os.path.join(inside, "data", "files")), "the data dir is not on the tmpfs"
        n = 48
        fid = upload(port, "\n".join(line(i, 2) for i in range(n)) + "\n")
        st, data = call(port, "POST", "/v1/batches", json.dumps(
            {"input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h"}),
            {"Content-Type": "application/json"})
        assert st == 200, (st, data)
        bid = json.loads(data)["id"]
        filler = os.path.join(inside, "filler")
        fill(filler)
        # results now wait: the store says so, and the batch does not move
        deadline, health = time.time() + 240, b""
        while time.time() < deadline:
            st, health = call(port, "GET", "/health")
            if b"failing" in health:
                break
            time.sleep(0.2)
        assert st == 200 and b'"batch_store"' in health and b"failing" in health, (st, health)
        m = lib.parse_metrics(call(port, "GET", "/metrics")[1].decode())
        assert m["sluice:batch_store_failing"] == 1 and m["sluice:batch_store_write_errors_total"] >= 1, m
        time.sleep(1.5)  # more results finish and wait; nothing new is fed meanwhile
        b1 = json.loads(call(port, "GET", f"/v1/batches/{bid}")[1])
        time.sleep(1.0)
        b2 = json.loads(call(port, "GET", f"/v1/batches/{bid}")[1])
        assert b1["request_counts"] == b2["request_counts"] and b2["status"] == "in_progress", (b1, b2)
        m = lib.parse_metrics(call(port, "GET", "/metrics")[1].decode())
        waiting = m["sluice:batch_results_waiting"]
        assert m["sluice:num_requests_running"] + m["sluice:num_requests_waiting"] <= 8, m
        print(f"     disk full at {b2['request_counts']['completed']}/{n} written; {waiting:.0f} results "
              f"waiting in memory", flush=True)
        os.unlink(filler)  # space returns
        deadline = time.time() + 300
        while True:
            b = json.loads(call(port, "GET", f"/v1/batches/{bid}")[1])
            if b["status"] not in ("validating", "in_progress", "finalizing"):
                break
            assert time.time() < deadline, b
            time.sleep(0.3)
        assert b["status"] == "completed", b
        assert b["request_counts"] == {"total": n, "completed": n, "failed": 0}, b
        st, data = call(port, "GET", f"/v1/files/{b['output_file_id']}/content")
        out = [json.loads(x) for x in data.decode().splitlines()]
        assert [o["custom_id"] for o in out] == [f"df{i:04d}" for i in range(n)], "every row once, in order"
        rids = [o["response"]["request_id"] for o in out]
        bad = [r for r in rids if not re.fullmatch(r"req_[0-9a-f]{24}", r or "")]
        assert not bad and len(set(rids)) == n, f"request_ids corrupted or repeated: {bad[:5]}"
        assert all(o["response"]["status_code"] == 200 and o["response"]["body"]["choices"] for o in out)
        st, health = call(port, "GET", "/health")
        assert st == 200 and health == b"", health
        assert lib.parse_metrics(call(port, "GET", "/metrics")[1].decode())["sluice:batch_store_failing"] == 0
    finally:
        lib.stop_server(proc, timeout=15)


def test_refuses_foreign_dir():
    d = os.path.join(TMP, "not-a-data-dir")
    os.makedirs(os.path.join(d, "tmp"))
    os.makedirs(os.path.join(d, "files"))
    for p, text in (("tmp/notes.txt", "a\n"), ("files/thesis.docx", "b\n")):
        with open(os.path.join(d, p), "w") as f:
            f.write(text)
    r = subprocess.run([BIN, "serve", MODEL, "--port", str(free_port()), "--data-dir", d], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode != 0 and "refusing" in r.stderr and "no sluice database" in r.stderr, r.stderr[-2000:]
    assert sorted(os.listdir(d)) == ["files", "tmp"], os.listdir(d)
    assert open(os.path.join(d, "tmp/notes.txt")).read() == "a\n"
    assert open(os.path.join(d, "files/thesis.docx")).read() == "b\n"


def test_run_batch_duplicate_ids():
    lines = [line(0), line(1), "", line(0), json.dumps({"custom_id": "df0001", "method": "POST"}), line(2)]
    src = os.path.join(TMP, "dups.jsonl")
    with open(src, "w") as f:
        f.write("\n".join(lines) + "\n")
    out = os.path.join(TMP, "dups.out.jsonl")
    for args, stdin in (([src], None), (["-"], "\n".join(lines) + "\n")):
        r = subprocess.run([BIN, "run-batch", "--model", MODEL, "-i", args[0], "-o", out, "--quiet"],
                           input=stdin, capture_output=True, text=True, timeout=120)
        assert r.returncode == 1, (r.returncode, r.stderr)
        assert "'df0000' is used on lines 1, 4" in r.stderr and "'df0001' is used on lines 2, 5" in r.stderr, r.stderr
        assert "2 custom_ids are used more than once" in r.stderr, r.stderr
        assert not os.path.exists(out), "nothing is written for a refused file"
    # unique ids run as before
    with open(src, "w") as f:
        f.write(line(0, 1) + "\n" + line(1, 1) + "\n")
    r = subprocess.run([BIN, "run-batch", "--model", MODEL, "-i", src, "-o", out, "--quiet", "--max-model-len",
                        "256", "--kv-cache-memory", "64M"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert [json.loads(x)["custom_id"] for x in open(out)] == ["df0000", "df0001"]


def main():
    if lib.missing_prereqs("test_store_faults"):
        return 1
    try:
        passed, failed = lib.run_tests([test_refuses_foreign_dir, test_run_batch_duplicate_ids, test_disk_full],
                                       only=sys.argv[1:])
    except Exception:
        passed, failed = 0, 1
        print("FAIL setup")
        traceback.print_exc(file=sys.stdout)
    finally:
        shutil.rmtree(TMP, ignore_errors=True)
    return lib.summary(passed, failed)


if __name__ == "__main__":
    sys.exit(main())
