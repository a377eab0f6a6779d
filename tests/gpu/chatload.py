"""chatload.py - the client side of the served benchmarks (scenarios.py,
run by tests/gpu/run.sh bench): prompts of about N tokens cut from the
bench corpus, and streamed chats timed per chunk. Run from the repository
root."""
import http.client
import json
import random

_words = None


def text_of(ntok, seed):
    """About ntok tokens (~1.3 a word) of the corpus from a place seed picks,
    wrapping around it for prompts longer than it; the seed leads, so two
    seeds share no prefix."""
    global _words
    if _words is None:
        _words = open("tools/bench/corpus/python-reference.txt").read().split()
    rnd = random.Random(seed)
    n = int(ntok * 0.75)
    if 4 * ntok < len(_words):
        start = rnd.randrange(len(_words) - 4 * ntok)
        return f"Document {seed}: " + " ".join(_words[start:start + n])
    start = rnd.randrange(len(_words))
    return f"Document {seed}: " + " ".join(_words[(start + i) % len(_words)] for i in range(n))


def stream_chat(port, text, max_tokens, clock):
    """Streams one chat (greedy, ignore_eos); returns (t0, [times of chunks
    with text]) on clock (time.perf_counter)."""
    body = {"model": "m", "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "stream": True, "temperature": 0, "ignore_eos": True}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    t0 = clock()
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = c.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"chat: HTTP {resp.status}: {resp.read()[:300]!r}")
    times = []
    while True:
        line = resp.readline()
        if not line:
            break
        if not line.startswith(b"data: {"):
            continue
        ch = json.loads(line[6:]).get("choices") or [{}]
        if (ch[0].get("delta") or {}).get("content"):
            times.append(clock())
    return t0, times
