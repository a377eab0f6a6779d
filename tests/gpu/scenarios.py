#!/usr/bin/env python3
"""scenarios.py - the served and offline benchmarks behind `tests/gpu/run.sh
bench` (which passes the options of each current figure; see BENCHMARKS.md).
By default a server (or run-batch) on the Llama-3.1-8B shape with dummy
weights, the 49K vocabulary and tiny-qwen3's tokenizer, on the GPU, and
clients that time what a user sees. Run from the repository root:

    python3 tests/gpu/scenarios.py NAME --log DIR [common options] [NAME's options]

NAME:
  chat-beside-batch  streamed chats with the engine idle, then while a Batch
                     API job saturates it: their time to first token and
                     between tokens, and the batch's rates
  long-prompt-chat   one long chat prompt alone, then again with short chats
                     arriving 0.5 s apart: their TTFT and gaps during its prefill
  hit-ttft           one long prompt (a miss), then again (hits): client and
                     server TTFT of each
  small-batch-chat   N streamed chats at once: time between tokens, output tok/s
  serve-bench        `sluice bench` against the server: cache bust and hit
  run-batch          `sluice run-batch` of N requests (~1000 in, 1000 out):
                     output tok/s, load included
Common options: --sluice BIN (build/sluice), --tp N, --kv-cache-dtype DTYPE,
--serve-arg FLAG (repeatable: more `serve` / `run-batch` flags),
--model-args "..." (instead of the dummy 8B shape; a dry run on the CPU:
--model-args "tests/models/tiny-qwen3 --device cpu" with small prompts).
"""
import argparse
import http.client
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import threading
import time
import uuid

sys.path.insert(0, "tests")
sys.path.insert(0, "tests/gpu")
import sluice_testlib as lib  # noqa: E402
from chatload import stream_chat, text_of  # noqa: E402

DUMMY_8B = ("tools/configs/llama-3.1-8b-vocab49k --load-format dummy --tokenizer tests/models/tiny-qwen3 "
            "--device cuda")
clock = time.perf_counter


class Server:
    """`sluice serve` with the model args and flags, up (/health 200) or the
    run ends; its output in LOG/server.log."""

    def __init__(self, a, kv_memory, flags):
        self.port = lib.free_port()
        model = shlex.split(a.model_args) if a.model_args else shlex.split(DUMMY_8B) + ["--kv-cache-memory", kv_memory]
        cmd = [a.sluice, "serve"] + model + ["--served-model-name", "m", "--port", str(self.port),
                                             "--data-dir", os.path.join(a.log, "data")] + flags + common_flags(a)
        print("serve:", " ".join(shlex.quote(c) for c in cmd[2:]), flush=True)
        self.path = os.path.join(a.log, "server.log")
        self.out = open(self.path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT)
        t0 = time.time()
        if not lib.wait_healthy(self.port, self.proc, timeout=300, interval=0.5):
            self.stop()
            sys.exit("the server exited, or did not answer /health in 300 s")
        print(f"server up after ~{time.time() - t0:.0f} s", flush=True)

    def req(self, method, path, body=None, headers=None):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=900)
        c.request(method, path, body, headers or {"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()

    def metrics(self):
        out = {}
        for line in self.req("GET", "/metrics")[1].decode().splitlines():
            if line.startswith("sluice:") and " " in line and "{" not in line:
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def stop(self):
        lib.stop_server(self.proc, timeout=30)
        self.out.close()
        for line in open(self.path):
            if "rror" in line:
                print("server:", line.rstrip())


def common_flags(a):
    f = []
    if a.tp > 1:
        f += ["--tensor-parallel-size", str(a.tp)]
    if a.kv_cache_dtype:
        f += ["--kv-cache-dtype", a.kv_cache_dtype]
    return f + a.serve_arg


def chat_beside_batch(a):
    s = Server(a, "60G", ["--max-model-len", str(a.max_model_len), "--max-num-seqs", "256",
                          "--max-num-batched-tokens", "8192"])
    try:
        def chat(seed):
            t0, times = stream_chat(s.port, text_of(a.prompt, seed), 64, clock)
            ttft = times[0] - t0 if times else float("inf")
            itl = (times[-1] - times[0]) / max(len(times) - 1, 1) if times else float("nan")
            return ttft, itl, len(times)

        def chats(tag, base, concurrent=False):
            if concurrent:  # all at once, each on its own thread
                res = [None] * a.chats
                th = [threading.Thread(target=lambda k=k: res.__setitem__(k, chat(base + k)))
                      for k in range(a.chats)]
                for t in th:
                    t.start()
                for t in th:
                    t.join()
            else:
                res = [chat(base + k) for k in range(a.chats)]
            tt = sorted(r[0] * 1e3 for r in res)
            it = [r[1] * 1e3 for r in res]
            print(f"{tag}: TTFT ms in order: {[round(r[0] * 1e3) for r in res]}")
            print(f"{tag}: {a.chats} chats, TTFT median {statistics.median(tt):.1f} ms, max {tt[-1]:.1f} ms; "
                  f"between chunks median {statistics.median(it):.2f} ms, max {max(it):.2f} ms", flush=True)

        chats("idle", 1000)
        lines = []
        for k in range(a.batch):
            body = {"model": "m", "messages": [{"role": "user", "content": text_of(a.batch_prompt, 50000 + k)}],
                    "max_tokens": a.batch_out, "ignore_eos": True, "temperature": 0}
            lines.append(json.dumps({"custom_id": f"r{k}", "method": "POST", "url": "/v1/chat/completions",
                                     "body": body}))
        data = ("\n".join(lines) + "\n").encode()
        bnd = uuid.uuid4().hex
        form = (f"--{bnd}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                f"--{bnd}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"b.jsonl\"\r\n"
                f"Content-Type: application/jsonl\r\n\r\n").encode() + data + f"\r\n--{bnd}--\r\n".encode()
        fid = json.loads(s.req("POST", "/v1/files", form,
                               {"Content-Type": f"multipart/form-data; boundary={bnd}"})[1])["id"]
        bid = json.loads(s.req("POST", "/v1/batches", json.dumps({"input_file_id": fid,
                                                                  "endpoint": "/v1/chat/completions",
                                                                  "completion_window": "24h"}))[1])["id"]
        batch = lambda: json.loads(s.req("GET", f"/v1/batches/{bid}")[1])  # noqa: E731
        print(f"batch {bid}: {a.batch} lines of ~{a.batch_prompt} prompt tokens, {a.batch_out} out; "
              f"{len(data) / 1e6:.1f} MB", flush=True)
        t0 = time.time()
        mb = m = s.metrics()
        while time.time() - t0 < 120:
            m = s.metrics()
            if m.get("sluice:num_requests_running", 0) >= a.running:
                break
            if batch()["status"] in ("completed", "failed"):
                break
            time.sleep(0.5)
        print(f"engine running {m.get('sluice:num_requests_running', 0):.0f} sequences after {time.time() - t0:.1f} s")
        # the batch alone, then beside the chats: its prefill and decode tokens a second in each window
        ma, ta = s.metrics(), time.time()
        time.sleep(a.alone)
        m0, b0, t1 = s.metrics(), batch()["request_counts"]["completed"], time.time()
        rate = lambda x, y, t, k: (y.get("sluice:" + k, 0) - x.get("sluice:" + k, 0)) / t  # noqa: E731
        alone = [rate(ma, m0, t1 - ta, k) for k in ("prefill_tokens_computed_total", "decode_tokens_total")]
        print(f"batch alone ({t1 - ta:.1f} s): {alone[0]:.0f} prefill tok/s, {alone[1]:.0f} decode tok/s", flush=True)
        chats("beside the batch", 2000)
        m1, t2 = s.metrics(), time.time()
        b1 = batch()["request_counts"]["completed"]
        beside = [rate(m0, m1, t2 - t1, k) for k in ("prefill_tokens_computed_total", "decode_tokens_total")]
        print(f"batch beside the chats: prefill {beside[0] / max(alone[0], 1) * 100:.0f}% and decode "
              f"{beside[1] / max(alone[1], 1) * 100:.0f}% of alone", flush=True)
        if a.concurrent:
            mc, tc = s.metrics(), time.time()
            chats(f"{a.chats} at once beside the batch", 3000, concurrent=True)
            mc1, tc1 = s.metrics(), time.time()
            conc = [rate(mc, mc1, tc1 - tc, k) for k in ("prefill_tokens_computed_total", "decode_tokens_total")]
            print(f"batch beside {a.chats} chats at once: prefill {conc[0] / max(alone[0], 1) * 100:.0f}% and decode "
                  f"{conc[1] / max(alone[1], 1) * 100:.0f}% of alone", flush=True)
        d = lambda k: m1.get("sluice:" + k, 0) - m0.get("sluice:" + k, 0)  # noqa: E731
        steps, ttft_n = d("engine_steps_total"), d("time_to_first_token_seconds_count")
        print(f"during the chats ({t2 - t1:.1f} s): {m1.get('sluice:num_requests_running', 0):.0f} running, "
              f"{d('decode_tokens_total') / (t2 - t1):.0f} decode tok/s, "
              f"{d('prefill_tokens_computed_total') / (t2 - t1):.0f} prefill tok/s, batch lines done {b0} -> {b1}; "
              f"{steps:.0f} steps, {(t2 - t1) / max(steps, 1) * 1e3:.1f} ms each; server TTFT mean "
              f"{d('time_to_first_token_seconds_sum') / max(ttft_n, 1) * 1e3:.1f} ms over {ttft_n:.0f}; queue time "
              f"mean {d('request_queue_time_seconds_sum') / max(d('request_queue_time_seconds_count'), 1) * 1e3:.1f} "
              f"ms; preemptions {d('num_preemptions_total'):.0f}", flush=True)
        if a.wait:
            while batch()["status"] not in ("completed", "failed", "expired"):
                time.sleep(0.25)
            m2, t3, bt = s.metrics(), time.time(), batch()
            pre = m2.get("sluice:prefill_tokens_computed_total", 0) - mb.get("sluice:prefill_tokens_computed_total", 0)
            print(f"batch {bt['status']} {bt['request_counts']} in {t3 - t0:.1f} s: {pre / (t3 - t0):.0f} prefill "
                  f"tok/s overall ({pre:.0f} tokens, chats' included)")
        else:
            st, out = s.req("POST", f"/v1/batches/{bid}/cancel")
            print("cancel:", st, json.loads(out).get("status"))
    finally:
        s.stop()


def long_prompt_chat(a):
    s = Server(a, "60G", ["--max-model-len", str(a.max_model_len), "--max-num-batched-tokens", "8192"])
    try:
        stream_chat(s.port, text_of(a.prompt, 1), 8, clock)  # warm
        t0, times = stream_chat(s.port, text_of(a.long_prompt, 2), 4, clock)
        print(f"long prompt alone: TTFT {(times[0] - t0) * 1e3:.0f} ms", flush=True)
        res = {}

        def run(key, text, n):
            try:
                res[key] = stream_chat(s.port, text, n, clock)
            except Exception as e:  # reported below
                res[key] = e

        th = [threading.Thread(target=run, args=("long", text_of(a.long_prompt, 3), 4))]
        th[0].start()
        for k in range(a.chats):
            time.sleep(0.5)
            th.append(threading.Thread(target=run, args=(k, text_of(a.prompt, 100 + k), 64)))
            th[-1].start()
        for t in th:
            t.join()
        bad = [v for v in res.values() if isinstance(v, Exception)]
        if bad:
            sys.exit(f"failed: {bad[0]}")
        lt0, lts = res["long"]
        end = lts[0]  # the long prompt's prefill ends with its first token
        print(f"long prompt beside {a.chats} chats: TTFT {(end - lt0) * 1e3:.0f} ms")
        ttft, gaps, during = [], [], 0
        for k in range(a.chats):
            c0, ts = res[k]
            ttft.append((ts[0] - c0) * 1e3)
            gaps += [(y - x) * 1e3 for x, y in zip(ts, ts[1:]) if y <= end]
            during += sum(1 for t in ts if t <= end)
        print(f"chats: TTFT ms {[round(x) for x in ttft]}, median {statistics.median(ttft):.0f}, max {max(ttft):.0f}")
        if gaps:
            gaps.sort()
            print(f"chats' gaps between chunks during the long prefill: {len(gaps)}, median "
                  f"{statistics.median(gaps):.0f} ms, p90 {gaps[int(0.9 * (len(gaps) - 1))]:.0f} ms, max "
                  f"{gaps[-1]:.0f} ms; {during} chunks in {(end - lt0):.1f} s")
    finally:
        s.stop()


def hit_ttft(a):
    s = Server(a, "40G", ["--max-model-len", str(a.max_model_len), "--max-num-batched-tokens", "8192"])
    try:
        def count(t):
            return json.loads(s.req("POST", "/tokenize", json.dumps(
                {"model": "m", "messages": [{"role": "user", "content": t}]}))[1])["count"]

        text = " ".join(open("tools/bench/corpus/python-reference.txt").read().split())
        while count(text) < a.prompt:  # a longer prompt than the corpus: the corpus again
            text = text + "\n\n" + text
        while True:
            n = count(text)
            if n <= a.prompt:
                break
            text = text[: int(len(text) * a.prompt / n * 0.995)]
        print("prompt tokens", n)

        def metric(name):
            return s.metrics().get(name, float("nan"))

        def chat(tag):
            s0 = metric("sluice:time_to_first_token_seconds_sum")
            t0, times = stream_chat(s.port, text, 16, clock)
            s1 = metric("sluice:time_to_first_token_seconds_sum")
            ttft = times[0] - t0
            print(f"{tag}: client TTFT {ttft * 1e3:.1f} ms, server TTFT {(s1 - s0) * 1e3:.1f} ms, {len(times)} "
                  f"chunks, {(times[-1] - times[0]) / max(len(times) - 1, 1) * 1e3:.2f} ms per later chunk",
                  flush=True)

        chat("miss")
        for k in range(a.hits):
            chat(f"hit {k}")
        for _ in range(3):
            t0 = clock()
            count(text)
            print(f"/tokenize round trip {(clock() - t0) * 1e3:.1f} ms")
    finally:
        s.stop()


def small_batch_chat(a):
    s = Server(a, "20G", ["--max-model-len", "4096"])
    try:
        stream_chat(s.port, text_of(a.prompt, 1), 8, clock)  # warm
        out = a.out
        for n in a.n:
            for rnd in range(2):
                res = {}

                def run(i):
                    res[i] = stream_chat(s.port, text_of(a.prompt, 1000 * n + 100 * rnd + i), out, clock)

                th = [threading.Thread(target=run, args=(i,)) for i in range(n)]
                t0 = clock()
                for t in th:
                    t.start()
                for t in th:
                    t.join()
                t1 = clock()
                gaps = [(y - x) * 1e3 for i in range(n) for x, y in zip(res[i][1][out // 4:], res[i][1][out // 4 + 1:])]
                chunks = sum(len(res[i][1]) for i in range(n))
                print(f"{n} chats, round {rnd + 1}: between chunks median {statistics.median(gaps):.2f} ms; "
                      f"{chunks / (t1 - t0):.0f} output tok/s over {t1 - t0:.2f} s", flush=True)
    finally:
        s.stop()


def serve_bench(a):
    s = Server(a, "40G", ["--max-model-len", "16384", "--max-num-batched-tokens", "8192",
                          "--enable-prompt-tokens-details"])
    try:
        r = subprocess.run([a.sluice, "bench", "--url", f"http://127.0.0.1:{s.port}", "--model", "m",
                            "--prompt-tokens", str(a.prompt), "--max-tokens", "256", "--runs", str(a.runs)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
        print(r.stdout, end="")
        print(f"bench rc={r.returncode}")
    finally:
        s.stop()


def run_batch(a):
    random.seed(7)
    words = ("the of and to in is was for on that with as by at from his her they this which were "
             "river mountain city language science music history water light system market energy "
             "people story garden window morning winter number paper island").split()
    inp, outp = os.path.join(a.log, "in.jsonl"), os.path.join(a.log, "out.jsonl")
    with open(inp, "w") as f:
        for i in range(a.requests):
            text = f"{i} " + " ".join(random.choice(words) for _ in range(980))
            body = {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 1000,
                    "temperature": 0, "ignore_eos": True}
            f.write(json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
                                "body": body}) + "\n")
    model = (shlex.split(a.model_args) if a.model_args else
             shlex.split(DUMMY_8B.replace("llama-3.1-8b-vocab49k", "llama-3.1-8b")) + ["--kv-cache-memory", "80G"])
    cmd = [a.sluice, "run-batch", "--model"] + model + ["--served-model-name", "m", "-i", inp, "-o", outp,
                                                        "--max-num-seqs", "256", "--max-num-batched-tokens", "8192",
                                                        "--max-model-len", "2304", "--quiet"] + common_flags(a)
    print("run-batch:", " ".join(shlex.quote(c) for c in cmd[2:]), flush=True)
    t0 = time.time()
    rc = subprocess.run(cmd, timeout=3000).returncode
    dt = time.time() - t0
    pt = ct = n = 0
    for line in open(outp):
        u = ((json.loads(line).get("response") or {}).get("body") or {}).get("usage") or {}
        pt += u.get("prompt_tokens", 0)
        ct += u.get("completion_tokens", 0)
        n += 1
    print(f"run-batch rc={rc}: {n} requests, {pt} prompt + {ct} output tokens in {dt:.1f} s (load included): "
          f"{ct / dt:.0f} output tok/s, {(pt + ct) / dt:.0f} total tok/s")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log", required=True, help="folder for the logs (made if absent)")
    p.add_argument("--sluice", default="build/sluice")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--kv-cache-dtype", default=None)
    p.add_argument("--serve-arg", action="append", default=[])
    p.add_argument("--model-args", default=None)
    sub = p.add_subparsers(dest="name", required=True)
    c = sub.add_parser("chat-beside-batch")
    c.add_argument("--chats", type=int, default=8)
    c.add_argument("--prompt", type=int, default=500)
    c.add_argument("--batch", type=int, default=2000)
    c.add_argument("--batch-prompt", type=int, default=3000)
    c.add_argument("--batch-out", type=int, default=128)
    c.add_argument("--running", type=int, default=60, help="chat once this many sequences run")
    c.add_argument("--wait", action="store_true", help="wait for the batch (else cancel it)")
    c.add_argument("--max-model-len", type=int, default=4096)
    c.add_argument("--alone", type=float, default=8.0, help="seconds the batch runs alone before the chats")
    c.add_argument("--concurrent", action="store_true", help="then the chats once more, all at once")
    c = sub.add_parser("long-prompt-chat")
    c.add_argument("--long-prompt", type=int, default=100000)
    c.add_argument("--chats", type=int, default=6)
    c.add_argument("--prompt", type=int, default=500)
    c.add_argument("--max-model-len", type=int, default=131072)
    c = sub.add_parser("hit-ttft")
    c.add_argument("--prompt", type=int, default=14600)
    c.add_argument("--hits", type=int, default=6)
    c.add_argument("--max-model-len", type=int, default=16384)
    c = sub.add_parser("small-batch-chat")
    c.add_argument("--n", type=int, nargs="+", default=[1, 2, 4])
    c.add_argument("--prompt", type=int, default=200)
    c.add_argument("--out", type=int, default=256)
    c = sub.add_parser("serve-bench")
    c.add_argument("--prompt", type=int, default=14600)
    c.add_argument("--runs", type=int, default=3)
    c = sub.add_parser("run-batch")
    c.add_argument("--requests", type=int, default=1000)
    a = p.parse_args()
    os.makedirs(a.log, exist_ok=True)
    {"chat-beside-batch": chat_beside_batch, "long-prompt-chat": long_prompt_chat, "hit-ttft": hit_ttft,
     "small-batch-chat": small_batch_chat, "serve-bench": serve_bench, "run-batch": run_batch}[a.name](a)


if __name__ == "__main__":
    main()
