#!/usr/bin/env python3
"""power_sum.py CSV LOG - the GPU's power and SM clock while each timed run
of a bench log ran (tests/gpu/run.sh bench power).

CSV: nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw.instant,
power.draw.average,enforced.power.limit,temperature.gpu,
clocks_event_reasons.active --format=csv,noheader,nounits -lms 20 (where
nvidia-smi refuses those two power fields, power.draw twice: the third
field is the power used below).
LOG: the bench's stdout, each line prefixed with the time it arrived
("YYYY/MM/DD HH:MM:SS.mmm ", nvidia-smi's format, the same clock). A run's
window is the span its line reports, ending when the line arrived:
bench_gemm's "sustained" lines (3 x the ms per 32 layers) and bench_gpu's
"sustained" lines (8 x the ms a step). For each: the samples inside it, the
median and mean power, the enforced limit, the median SM clock, the
clock-event reasons seen, and the energy of a step or of 32 layers of
GEMMs (mean power x its time)."""
import re
import statistics
import sys
from datetime import datetime


def ts(s):
    return datetime.strptime(s.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()


def num(s):
    try:
        return float(s)
    except ValueError:
        return None


rows = []
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(",")]
    if len(f) < 7:
        continue
    try:
        t = ts(f[0])
    except ValueError:
        continue
    rows.append((t, num(f[1]), num(f[2]), num(f[3]), num(f[4]), num(f[5]), f[6]))
print(f"{len(rows)} samples")
runs = [  # a line's pattern, how many of its reported spans the run lasted, its name, what the energy covers
    (re.compile(r"sustained, (\w+) activations.*: ([\d.]+) ms per 32 layers"), 3, "bench_gemm {0}: {1} ms / 32 layers",
     "32 layers"),
    (re.compile(r"prefill (\d+) x 2048 sustained.*: ([\d.]+) ms a step"), 8, "bench_gpu {0} x 2048: {1} ms a step",
     "a step"),
]
for line in open(sys.argv[2]):
    m0 = re.match(r"(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\.\d+) (.*)", line.rstrip("\n"))
    if not m0:
        continue
    end, text = ts(m0.group(1)), m0.group(2)
    for rx, mult, name, per in runs:
        m = rx.search(text)
        if not m:
            continue
        span = float(m.group(2)) / 1e3
        inside = [r for r in rows if end - mult * span <= r[0] <= end]
        pw = [r[2] for r in inside if r[2] is not None]
        ck = [r[1] for r in inside if r[1] is not None]
        if not pw or not ck:
            print(name.format(*m.groups()), ": no samples")
            continue
        lim = max((r[4] for r in inside if r[4] is not None), default=0)
        reasons = sorted({r[6] for r in inside})
        mean = statistics.mean(pw)
        print(f"{name.format(*m.groups())}: {len(inside)} samples; power median {statistics.median(pw):.0f} W, "
              f"mean {mean:.0f} W, min {min(pw):.0f}, max {max(pw):.0f} (limit {lim:.0f} W); "
              f"SM clock median {statistics.median(ck):.0f} MHz ({min(ck):.0f}-{max(ck):.0f}); "
              f"{per} {mean * span:.1f} J; reasons {' '.join(reasons)}")
