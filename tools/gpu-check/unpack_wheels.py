#!/usr/bin/env python3
"""Unpacks wheels into one folder that PYTHONPATH can name.

    unpack_wheels.py DEST [--libs NAME,...] WHEEL...

What pip install --target does for a pure wheel, without pip: the GPU
machines' python may lack it, and nothing there can be installed from an
index. The .dist-info folders come along, so importlib.metadata finds each
package's version (transformers asks it of bitsandbytes). With --libs, a
shared library (*.so) is kept only when its file name is in the list: the
bitsandbytes wheel carries one library per CUDA and ROCm version (43 MB),
of which a torch built for one CUDA loads one. A wheel with a .data folder
(scripts, headers, platlib) is refused: that needs an installer.
"""
import os, sys, zipfile

def main():
    args = sys.argv[1:]
    dest, libs = args.pop(0), None
    if args and args[0] == "--libs":
        libs = set(args[1].split(","))
        args = args[2:]
    os.makedirs(dest, exist_ok=True)
    for wheel in args:
        with zipfile.ZipFile(wheel) as z:
            names = z.namelist()
            data = [n for n in names if n.split("/")[0].endswith(".data")]
            if data:
                sys.exit(f"unpack_wheels: {wheel} has a .data folder ({data[0]}): install it with pip")
            keep = [n for n in names
                    if libs is None or not n.endswith(".so") or os.path.basename(n) in libs]
            z.extractall(dest, keep)
            print(f"  {os.path.basename(wheel)}: {len(keep)} of {len(names)} files")

main()
