#!/usr/bin/env python3
"""power_sum.py CSV LOG - the GPU's power and SM clock while each timed run
of a bench log ran (power32_run.sh).

CSV: nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw.instant,
power.draw.average,enforced.power.limit,temperature.gpu,
clocks_event_reasons.active --format=csv,noheader,nounits -lms 20.
LOG: the bench's stdout, each line prefixed with the time it arrived
("YYYY/MM/DD HH:MM:SS.mmm ", nvidia-smi's format, the same clock). A run's
window is the span its line reports, ending when the line arrived:
bench_gemm's "sustained" lines (3 x the ms per 32 layers) and bench_gpu's
"sustained" lines (8 x the ms a step). For each: the samples inside it, the
median and mean instant power, the enforced limit, the median SM clock, the
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
runs = [
    (re.compile(r"sustained, (\w+) activations.*: ([\d.]+) ms per 32 layers"), 3, "bench_gemm {0}: {1} ms / 32 layers"),
    (re.compile(r"prefill (\d+) x 2048 sustained.*: ([\d.]+) ms a step"), 8, "bench_gpu {0} x 2048: {1} ms a step"),
]
for line in open(sys.argv[2]):
    m0 = re.match(r"(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\.\d+) (.*)", line.rstrip("\n"))
    if not m0:
        continue
    end, text = ts(m0.group(1)), m0.group(2)
    for rx, mult, name in runs:
        m = rx.search(text)
        if not m:
            continue
        ms = float(m.group(2))
        beg = end - mult * ms / 1e3
        inside = [r for r in rows if beg <= r[0] <= end]
        if not inside:
            print(name.format(*m.groups()), ": no samples")
            continue
        pw = [r[2] for r in inside if r[2] is not None]
        ck = [r[1] for r in inside if r[1] is not None]
        lim = [r[4] for r in inside if r[4] is not None]
        reasons = sorted({r[6] for r in inside})
        mean = statistics.mean(pw) if pw else float("nan")
        unit = ms / 1e3  # a step, or 32 layers of GEMMs
        print(f"{name.format(*m.groups())}: {len(inside)} samples; power median {statistics.median(pw):.0f} W, "
              f"mean {mean:.0f} W, min {min(pw):.0f}, max {max(pw):.0f} (limit {max(lim) if lim else 0:.0f} W); "
              f"SM clock median {statistics.median(ck):.0f} MHz ({min(ck):.0f}-{max(ck):.0f}); "
              f"{'a step' if mult == 8 else '32 layers'} {mean * unit:.1f} J; reasons {' '.join(reasons)}")
