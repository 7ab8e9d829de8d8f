#!/usr/bin/env python3
"""Sums gpu-check's kernel profile: where a training step's GPU time goes.

    kernel_profile.py CSV STEPS [TOP] [--cut]

CSV is `ncu --csv --metrics gpu__time_duration.sum` output (one row per
kernel launch; ncu's own log lines before the header are skipped). Prints the
launches and summed kernel time per step (over STEPS steps), then the TOP
kernels (default 20) by total time: launches, total and mean microseconds,
share of the whole. ncu runs kernels one at a time, so the total is the GPU's
own work: a step's wall time far above it means the step waits on launches.
--cut: the profile stopped early (the time limit, or ncu's --launch-count),
so fewer than STEPS steps are in it: the totals and the table still hold,
the per-step figures are then lower bounds. A cut CSV may end mid-row; the
rows before it count.
"""
import csv, io, re, sys
from collections import defaultdict

UNIT = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
        "second": 1e6, "s": 1e6}

def main():
    args = [a for a in sys.argv[1:] if a != "--cut"]
    cut = len(args) < len(sys.argv) - 1
    path, steps = args[0], int(args[1])
    top = int(args[2]) if len(args) > 2 else 20
    lines = open(path, errors="replace").read().splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        print("kernel profile: no CSV header in", path)
        return 1
    total = defaultdict(float)
    count = defaultdict(int)
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if row.get("Metric Name") != "gpu__time_duration.sum" or not row.get("Kernel Name"):
            continue
        try:
            us = float(row["Metric Value"].replace(",", "")) * UNIT[row.get("Metric Unit", "ns")]
        except (KeyError, ValueError, AttributeError, TypeError):
            continue
        # Template arguments and parameter lists make one kernel many names.
        name = re.sub(r"\(.*", "", row["Kernel Name"]).strip()
        total[name] += us
        count[name] += 1
    launches, gpu_us = sum(count.values()), sum(total.values())
    if not launches:
        print("kernel profile: no kernel timed")
        return 1
    bound = "at least " if cut else ""
    print(f"kernel profile: {launches} launches, {gpu_us:.0f} us of kernel time over {steps} steps:"
          f" {bound}{launches / steps:.0f} launches and {bound}{gpu_us / steps:.0f} us per step")
    if cut:
        print("  (cut short: fewer steps than that were profiled; the table's shares still hold)")
    print(f"{'kernel':60s} {'launches':>8s} {'total_us':>9s} {'mean_us':>8s} {'share':>6s}")
    for name in sorted(total, key=total.get, reverse=True)[:top]:
        print(f"{name[:60]:60s} {count[name]:8d} {total[name]:9.0f} "
              f"{total[name] / count[name]:8.2f} {total[name] / gpu_us:6.1%}")
    return 0

sys.exit(main())
