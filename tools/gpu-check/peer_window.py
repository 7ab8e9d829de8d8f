#!/usr/bin/env python3
"""One comparable throughput figure for a run of gpu-check's peer phase.

    peer_window.py LABEL RUN_DIR BATCH FROM TO

RUN_DIR is a `quanta train --out` folder or one of the PyTorch replica's
(../shared/peer/quanta_arch_fmnist.py --out); both write metrics.jsonl with a
"train" record every --log-every steps. Prints one line: images per second
over steps FROM+1..TO, from the records at steps FROM and TO, and the last
evaluation's test MSE and codebook usage. quanta's records carry elapsed_s;
the replica's carry img_per_s = step * batch / seconds since its loop began,
so its seconds are step * batch / img_per_s. Both sides read their losses
(waiting for the GPU) before writing a record, and neither evaluates inside
the window (both run with --eval-every equal to the step count): the same
window past warm-up, graph capture and torch.compile's compilation compares.
"""
import json, os, sys

def main():
    label, run, batch, first, last = sys.argv[1], sys.argv[2], int(sys.argv[3]), \
        int(sys.argv[4]), int(sys.argv[5])
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.exists(path):
        print(f"peer {label}: no metrics.jsonl (the run did not get far)")
        return
    records = []
    for line in open(path):
        try:
            records.append(json.loads(line))
        except ValueError:  # blank, or the last line of a run cut short
            pass
    seconds = {}
    for r in records:
        if r.get("kind") != "train":
            continue
        if "elapsed_s" in r:
            seconds[r["step"]] = r["elapsed_s"]
        elif r.get("img_per_s"):
            seconds[r["step"]] = r["step"] * batch / r["img_per_s"]
    evals = [r for r in records if r.get("kind") == "eval"]
    if first in seconds and last in seconds and seconds[last] > seconds[first]:
        rate = f"{(last - first) * batch / (seconds[last] - seconds[first]):8.0f} img/s"
    else:
        rate = "     n/a img/s"
    quality = "no evaluation"
    if evals:
        ev = evals[-1]
        usage = ev.get("codebook_usage")
        quality = f"test mse {ev['test_mse']:.5f}" + \
            ("" if usage is None else f", codebook usage {100 * usage:.1f}%")
    print(f"peer {label:22s} {rate} (steps {first + 1}-{last}), {quality}")

main()
