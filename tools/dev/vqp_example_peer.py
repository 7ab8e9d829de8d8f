#!/usr/bin/env python3
"""Runs one of vector-quantize-pytorch's example autoencoders as its author wrote it
(examples/autoencoder_fsq.py or autoencoder_lfq.py, fetched from the reference repository)
and evaluates the trained model on the Fashion-MNIST test set, for the side-by-side with
`quanta train --config tools/quanta/configs/vqp-example-*.json` in docs/train.md.

The example's own train() runs unchanged. Three things are supplied around it, because
the peer environment (../shared/peer) has no torchvision and no network:
  - `torchvision.datasets.FashionMNIST` and `torchvision.transforms` that read Debian's
    dataset-fashion-mnist files (the same bytes torchvision downloads) and apply
    ToTensor + Normalize as the examples ask;
  - `fire` (the examples only use it under __main__);
  - a wrapper around the example's model constructor that keeps the model it builds, and
    a `trange` that keeps the last progress description (the example's final figures).

Run in the peer venv (as root, after `sh ../shared/peer/setup.sh`):
  /tmp/peer-venv/bin/python tools/dev/vqp_example_peer.py EXAMPLE.py [--threads 1] [--seed S]
      [--train-iter N]
Prints one JSON object: the example's last progress line, and test-set figures in quanta's
units (test_mse and psnr on images in [0, 1], the L1 in the example's [-1, 1] units, code
usage and perplexity over all 10,000 test images), and the training time.
"""
import argparse
import gzip
import importlib.util
import inspect
import json
import math
import os
import sys
import time
import types

DATA = "/usr/share/datasets/fashion-mnist"


def read_idx(path):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return raw[4 + 4 * dims:], shape


def install_shims(torch):
    """torchvision.datasets/transforms and fire, enough for the examples."""

    class FashionMNIST(torch.utils.data.Dataset):
        def __init__(self, root=None, train=True, download=False, transform=None):
            split = "train" if train else "t10k"
            images, shape = read_idx(os.path.join(DATA, f"{split}-images-idx3-ubyte.gz"))
            labels, _ = read_idx(os.path.join(DATA, f"{split}-labels-idx1-ubyte.gz"))
            self.images = torch.frombuffer(bytearray(images), dtype=torch.uint8).view(*shape)
            self.labels = torch.frombuffer(bytearray(labels), dtype=torch.uint8).long()
            self.transform = transform

        def __len__(self):
            return self.images.shape[0]

        def __getitem__(self, i):
            x = self.images[i]
            return (self.transform(x) if self.transform else x), int(self.labels[i])

    class Compose:
        def __init__(self, steps):
            self.steps = steps

        def __call__(self, x):
            for s in self.steps:
                x = s(x)
            return x

    class ToTensor:  # uint8 HxW -> float 1xHxW in [0, 1]
        def __call__(self, x):
            return x.float().div(255).unsqueeze(0)

    class Normalize:
        def __init__(self, mean, std):
            self.mean, self.std = mean[0], std[0]

        def __call__(self, x):
            return (x - self.mean) / self.std

    tv = types.ModuleType("torchvision")
    tv.datasets = types.ModuleType("torchvision.datasets")
    tv.datasets.FashionMNIST = FashionMNIST
    tv.transforms = types.ModuleType("torchvision.transforms")
    tv.transforms.Compose, tv.transforms.ToTensor = Compose, ToTensor
    tv.transforms.Normalize = Normalize
    sys.modules.update({"torchvision": tv, "torchvision.datasets": tv.datasets,
                        "torchvision.transforms": tv.transforms})
    fire = types.ModuleType("fire")
    fire.Fire = lambda fn: None
    sys.modules["fire"] = fire
    return FashionMNIST, Compose, ToTensor, Normalize


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("example", help="autoencoder_fsq.py or autoencoder_lfq.py")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=None, help="the example's seed (default: its own)")
    ap.add_argument("--train-iter", type=int, default=None,
                    help="the example's steps (default: its own, 1000)")
    args = ap.parse_args()

    import torch
    torch.set_num_threads(args.threads)
    FashionMNIST, Compose, ToTensor, Normalize = install_shims(torch)

    spec = importlib.util.spec_from_file_location("vqp_example", args.example)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)

    built = {}
    for name in ("SimpleFSQAutoEncoder", "LFQAutoEncoder"):
        if hasattr(ex, name):
            make = getattr(ex, name)
            setattr(ex, name, lambda *a, _make=make, **k: built.setdefault("model", _make(*a, **k)))
    last = {}
    real_trange = ex.trange

    def trange(*a, **k):
        bar = real_trange(*a, **k)
        set_description = bar.set_description
        bar.set_description = lambda d, *x, **y: (last.__setitem__("progress", d),
                                                  set_description(d, *x, **y))
        return bar

    ex.trange = trange

    train_kwargs = {k: v for k, v in (("seed", args.seed), ("train_iter", args.train_iter))
                    if v is not None}
    start = time.time()
    ex.train(**train_kwargs)
    seconds = time.time() - start
    model = built["model"].eval()

    test = FashionMNIST(train=False, transform=Compose([ToTensor(), Normalize((0.5,), (0.5,))]))
    sq, ab, pixels, counts = 0.0, 0.0, 0, {}
    with torch.no_grad():
        for i in range(0, len(test), 500):
            x = torch.stack([test[j][0] for j in range(i, min(i + 500, len(test)))])
            out = model(x)
            recon, indices = out[0], out[1]
            recon = recon.clamp(-1.0, 1.0)
            sq += ((recon - x) / 2).pow(2).sum().item()  # on [0, 1]
            ab += (recon - x).abs().sum().item()  # the example's units
            pixels += x.numel()
            for v, c in zip(*torch.unique(indices, return_counts=True)):
                counts[int(v)] = counts.get(int(v), 0) + int(c)
    defaults = {k: v.default for k, v in inspect.signature(ex.train).parameters.items()}
    num_codes = (math.prod(defaults["levels"]) if "levels" in defaults
                 else defaults["codebook_size"])
    total = sum(counts.values())
    entropy = -sum(c / total * math.log(c / total) for c in counts.values())
    mse = sq / pixels
    print(json.dumps({
        "example": os.path.basename(args.example),
        "progress": last.get("progress"),
        "train_s": round(seconds, 1),
        "test_mse": mse,
        "psnr": 10 * math.log10(1 / mse),
        "test_l1": ab / pixels,
        "codebook_usage": len(counts) / num_codes,
        "perplexity": math.exp(entropy),
        "codes": num_codes,
    }))


if __name__ == "__main__":
    main()
