#!/usr/bin/env python3
"""ncu_sum.py LOG STEPS - sum an `ncu --metrics gpu__time_duration.sum --csv`
log per kernel name: total microseconds per step and launches per step,
largest first (used by profile_run.sh and prefill_prof_run.sh)."""
import collections
import csv
import sys

rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith('"'))]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 1
if not rows:
    sys.exit("no ncu rows in " + sys.argv[1])
h = rows[0]
ki, vi, ui = h.index("Kernel Name"), h.index("Metric Value"), h.index("Metric Unit")
tot = collections.OrderedDict()
cnt = collections.Counter()
for r in rows[1:]:
    v = float(r[vi].replace(",", ""))
    u = r[ui]
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    if u not in scale:
        sys.exit("unknown unit %r" % u)
    v *= scale[u]
    k = r[ki][:70]
    tot[k] = tot.get(k, 0) + v
    cnt[k] += 1
s = sum(tot.values())
print("kernels %d, sum of durations %.1f us over %d step(s) (%.1f us per step)" % (sum(cnt.values()), s, steps, s / steps))
for k, v in sorted(tot.items(), key=lambda x: -x[1]):
    print("%9.1f us/step %5d launches/step  %s" % (v / steps, cnt[k] // steps, k))
