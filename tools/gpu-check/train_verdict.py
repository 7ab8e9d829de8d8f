#!/usr/bin/env python3
"""Judges gpu-check's training phase: CPU and CUDA must reach the same test MSE.

    train_verdict.py DIR

DIR holds one `quanta train --out` folder per run, named QUANTIZER-DEVICE:
none-cpu, none-cuda, vq-cpu, vq-cuda. For each quantizer, prints one line
with the test_mse of the last "eval" record in each run's metrics.jsonl
(None when the run wrote none), the ratio cuda/cpu and PASS when it is
within 5% of 1, else FAIL. Exit status 1 when any quantizer FAILs.
"""
import json, os, sys
out = sys.argv[1]
def mse(run):
    path = os.path.join(out, run, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    ev = [json.loads(l) for l in open(path) if '"eval"' in l]
    return ev[-1]["test_mse"] if ev else None
bad = False
for q in ("none", "vq"):
    c, g = mse(f"{q}-cpu"), mse(f"{q}-cuda")
    ratio = g / c if c and g else None
    ok = ratio is not None and abs(ratio - 1) <= 0.05
    verdict = "PASS (within 5%)" if ok else "FAIL (not within 5%)"
    bad = bad or not ok
    shown = "none" if ratio is None else f"{ratio:.4f}"
    print(f"train {q}: test mse cpu {c}  cuda {g}  cuda/cpu {shown}  {verdict}")
sys.exit(1 if bad else 0)
