"""Shared helpers of the Python integration tests (tests/test_*.py).

Not a test itself: tools/run_tests.sh runs only tests/test_*.py. A test imports it with
    sys.path.insert(0, os.path.dirname(__file__))
    import sluice_testlib as lib
"""
import http.client
import math
import os
import re
import socket
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("SLUICE_BIN", os.path.join(ROOT, "build", "sluice"))
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def missing_prereqs(name):
    """True (after printing the reason and a failed summary) when build/sluice or the
    default model is missing."""
    if os.path.exists(BIN) and os.path.exists(MODEL):
        return False
    print(f"{name}: build/sluice or the default model is missing")
    print("0 passed, 1 failed")
    return True


def log_file(name, mode="w"):
    """build/NAME opened for a server's output."""
    os.makedirs(os.path.join(ROOT, "build"), exist_ok=True)
    return open(os.path.join(ROOT, "build", name), mode)


def start_server(args, stdout, **popen_kw):
    """`sluice serve MODEL args...` and the words of $SLUICE_TEST_SERVE_ARGS
    (e.g. --tensor-parallel-size=2 from `tests/gpu/run.sh check`), stderr
    joined to stdout."""
    extra = os.environ.get("SLUICE_TEST_SERVE_ARGS", "").split()
    return subprocess.Popen([BIN, "serve", MODEL] + list(args) + extra, stdout=stdout, stderr=subprocess.STDOUT,
                            **popen_kw)


def health(port, timeout=5):
    """The status of GET /health (no API key needed); raises OSError when nothing answers."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("GET", "/health")
        return c.getresponse().status
    finally:
        c.close()


def _exited(proc):
    """Whether proc (a Popen, or the pid of a server started elsewhere) has ended."""
    if isinstance(proc, int):
        try:
            os.kill(proc, 0)
            return False
        except OSError:
            return True
    return proc.poll() is not None


def wait_healthy(port, proc=None, timeout=120, interval=0.1):
    """Waits until /health answers 200: True; False when proc (a Popen or a pid) exits first or time runs out."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and _exited(proc):
            return False
        try:
            if health(port) == 200:
                return True
        except OSError:
            pass
        time.sleep(interval)
    return False


def stop_server(proc, timeout=10):
    """Terminates proc (killed if it does not exit within timeout); returns its
    captured stdout when it was a pipe, else None."""
    if proc.poll() is None:
        proc.terminate()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out


def parse_metrics(text):
    """The samples of a Prometheus /metrics text: {"name{labels}": value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def run_tests(tests, *args, proc=None, only=None):
    """Calls each test with args; prints "ok   name (time)" or "FAIL name" and the
    traceback. When proc (the server under test) exits, that is one more failure
    and the remaining tests are skipped. only: names to run (all when empty).
    Returns (passed, failed)."""
    passed = failed = 0
    for t in tests:
        if only and t.__name__ not in only:
            continue
        try:
            t0 = time.time()
            t(*args)
            passed += 1
            print(f"ok   {t.__name__} ({time.time() - t0:.1f}s)", flush=True)
        except Exception:
            failed += 1
            print(f"FAIL {t.__name__}", flush=True)
            traceback.print_exc(file=sys.stdout)
            sys.stdout.flush()
        if proc is not None and proc.poll() is not None:
            print("FAIL the server exited during the tests", flush=True)
            failed += 1
            break
    return passed, failed


# DESIGN.md, "Batch invariance": on the CPU a request's greedy tokens do not
# depend on what else ran in its steps; on the GPU, GEMM tiling and kernel
# choice change with the step's shape, so two runs may part at a near-tie of
# the top-2 logprobs (the bound tests/test_engine.c uses)
NEAR_TIE_NATS = 0.3
TOP_LOGPROBS = 5


def backend_in(text):
    """The backend ("cpu", "cuda") the last "ready" line of a server's output
    names; None when there is none."""
    m = re.findall(r" ready on \S+ \(backend (\w+),", text or "")
    return m[-1] if m else None


def log_backend(name):
    """backend_in() of build/NAME, a server's log."""
    try:
        with open(os.path.join(ROOT, "build", name), errors="replace") as f:
            return backend_in(f.read())
    except OSError:
        return None


def _get(o, k):
    return o.get(k) if isinstance(o, dict) else getattr(o, k, None)


def token_logprobs(logprobs):
    """A choice's logprobs (a dict, an openai object, or a list of their
    content entries, e.g. gathered from stream chunks) as [(token, [(token,
    logprob) of its top_logprobs])]."""
    if logprobs is None:
        return []
    content = logprobs if isinstance(logprobs, list) else _get(logprobs, "content")
    return [(_get(t, "token"), [(_get(x, "token"), _get(x, "logprob")) for x in (_get(t, "top_logprobs") or [])])
            for t in content or []]


def _parting(a_text, a_lp, b_text, b_lp, backend, same):
    """The start greedy_agree and sampled_agree share: (ok, why) where the
    texts settle it (same; else the CPU's exact rule; else no differing token
    in the logprobs), otherwise (None, (a, b, j)): both runs' token_logprobs
    and their first differing token."""
    if same:
        return True, ""
    if backend in (None, "cpu"):
        return False, f"{a_text!r} vs {b_text!r} (backend {backend}: exact)"
    a, b = token_logprobs(a_lp), token_logprobs(b_lp)
    j = 0
    while j < len(a) and j < len(b) and a[j][0] == b[j][0]:
        j += 1
    if j == len(a) or j == len(b):
        return False, f"{a_text!r} vs {b_text!r}: no differing token in the logprobs ({len(a)} / {len(b)} tokens)"
    return None, (a, b, j)


def greedy_agree(a_text, a_lp, b_text, b_lp, backend, prefix=False):
    """Whether two greedy runs of one request agree: the same text (with
    prefix, b's starts with a's). On the CPU nothing else passes. On another
    backend a first differing token also passes where it is a near-tie: the
    other run's token among either run's top logprobs there, less than
    NEAR_TIE_NATS below that run's own (a_lp, b_lp: token_logprobs' input,
    requested with top_logprobs TOP_LOGPROBS: three tokens may tie).
    Returns (ok, why); why names a near-tie, to be reported."""
    ok, parted = _parting(a_text, a_lp, b_text, b_lp, backend, b_text.startswith(a_text) if prefix else a_text == b_text)
    if ok is not None:
        return ok, parted
    a, b, j = parted
    ta, tb = a[j][0], b[j][0]
    for mine, other, run in ((ta, tb, a), (tb, ta, b)):
        top = dict(run[j][1])
        # greedy: a run's own token leads its top logprobs (to their 6 digits)
        if mine in top and other in top and -1e-4 < top[mine] - top[other] < NEAR_TIE_NATS:
            return True, (f"near-tie at token {j}: {ta!r} vs {tb!r}, logprobs {top[mine]:.4f} {top[other]:.4f} "
                          f"(backend {backend})")
    return False, f"token {j}: {ta!r} vs {tb!r} is not a near-tie (top {a[j][1]} / {b[j][1]}): " \
                  f"{a_text!r} vs {b_text!r}"


def _expect(verdict):
    """An (ok, why) verdict asserted; a tie or split it let pass is printed."""
    same, why = verdict
    assert same, why
    if why:
        print("     " + why, flush=True)


def expect_greedy_agree(a_text, a_lp, b_text, b_lp, backend, prefix=False):
    """greedy_agree, asserted; a near-tie it let pass is printed."""
    _expect(greedy_agree(a_text, a_lp, b_text, b_lp, backend, prefix))


M64 = (1 << 64) - 1
GOLDEN = 0x9e3779b97f4a7c15


def _splitmix(state):
    state = (state + GOLDEN) & M64
    z = ((state ^ (state >> 30)) * 0xbf58476d1ce4e5b9) & M64
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & M64
    return state, z ^ (z >> 31)


def seeded_draws(seed, choice=0):
    """The uniform draws, one a sampled token, of choice `choice` of a request
    with `seed`: api/openai.c's derived seed (seed + choice x the golden
    gamma), then model_rng_seed and model_rng_uniform (model/sampler.c)."""
    _, state = _splitmix(((seed + choice * GOLDEN) & M64) ^ 0x5851f42d4c957f2d)
    while True:
        state, z = _splitmix(state)
        yield (z >> 11) * 2.0 ** -53


def draw_pick(u, top, temperature, slack):
    """The token model_sample's draw u picks from top ([(token, logprob)]:
    a step's top_k candidates, best first), and whether u lies within slack
    of a boundary of their cumulative mass (then either side may be it)."""
    e = [math.exp((lp - top[0][1]) / temperature) for _, lp in top]
    z, cum, pick, near = sum(e), 0.0, top[-1][0], False
    for (tok, _), x in zip(top, e):
        near |= abs(u * z - cum) < slack * z
        cum += x
        if u * z < cum:
            return tok, near or abs(u * z - cum) < slack * z
    return pick, near


DRAW_SLACK = 1e-4  # of the mass: logprobs carry 6 significant digits


def sampled_agree(a_text, a_lp, b_text, b_lp, backend, seed, temperature, top_k, choice=0):
    """Whether two seeded runs of one request (temperature, top_k <= their
    top_logprobs; no top_p, min_p or penalties) agree: the same text. On the
    CPU nothing else passes. On another backend a first differing token j
    also passes where the draw explains it: the seed's j-th draw picks each
    run's own token from that run's top_k logprobs at j (so it lies between
    the two runs' boundaries), and the logprobs of the tokens both list
    differ by less than NEAR_TIE_NATS. Returns (ok, why); why names such a
    split, to be reported."""
    ok, parted = _parting(a_text, a_lp, b_text, b_lp, backend, a_text == b_text)
    if ok is not None:
        return ok, parted
    a, b, j = parted
    draws = seeded_draws(seed, choice)
    for _ in range(j):
        next(draws)
    u, ta, tb = next(draws), a[j][0], b[j][0]
    ka, kb = a[j][1][:top_k], b[j][1][:top_k]
    if len(ka) < top_k or len(kb) < top_k:
        return False, f"token {j}: {len(ka)} / {len(kb)} top logprobs, top_k {top_k} needs as many"
    (pa, _), (pb, _) = draw_pick(u, ka, temperature, DRAW_SLACK), draw_pick(u, kb, temperature, DRAW_SLACK)
    lb = dict(kb)
    gap = max([abs(lp - lb[t]) for t, lp in ka if t in lb] or [math.inf])
    what = f"token {j}: {ta!r} vs {tb!r}, draw {u:.4f} picks {pa!r} / {pb!r} (top {ka} / {kb})"
    if pa == ta and pb == tb and gap < NEAR_TIE_NATS:
        return True, f"sampled split at {what}, logprobs within {gap:.4f} (backend {backend})"
    return False, f"not a split the draw explains at {what}: {a_text!r} vs {b_text!r}"


def expect_sampled_agree(a_text, a_lp, b_text, b_lp, backend, seed, temperature, top_k, choice=0):
    """sampled_agree, asserted; a split it let pass is printed."""
    _expect(sampled_agree(a_text, a_lp, b_text, b_lp, backend, seed, temperature, top_k, choice))


def summary(passed, failed):
    """Prints the last line tools/run_tests.sh reads; returns the exit status."""
    print(f"{passed} passed, {failed} failed", flush=True)
    return 1 if failed else 0
