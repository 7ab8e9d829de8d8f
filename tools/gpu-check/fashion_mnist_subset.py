#!/usr/bin/env python3
"""Writes the first images of Fashion-MNIST's IDX files as a smaller copy.

    fashion_mnist_subset.py SRC DST

SRC is the dataset's folder (Debian's dataset-fashion-mnist puts it under
/usr/share/datasets/fashion-mnist); DST, created if need be, gets the same
four gzipped IDX files with the first 4096 training and 1024 test images and
labels, their headers' counts changed to match. tools/gpu-check.sh --bundle
puts this slice into the bundle (the GPU machines have no dataset package),
so that --run can train the same small job on the CPU and on the GPU.
"""
import gzip, struct, sys, os
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst, exist_ok=True)
for prefix, keep in (("train", 4096), ("t10k", 1024)):
    for kind in ("images-idx3", "labels-idx1"):
        name = f"{prefix}-{kind}-ubyte.gz"
        data = gzip.open(os.path.join(src, name)).read()
        ndim = data[3]
        dims = list(struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim]))
        per = 1
        for d in dims[1:]:
            per *= d
        head = data[:4] + struct.pack(">" + "I" * ndim, keep, *dims[1:])
        body = data[4 + 4 * ndim: 4 + 4 * ndim + keep * per]
        with gzip.open(os.path.join(dst, name), "wb", compresslevel=9) as f:
            f.write(head + body)
