"""Wheels that bring Ray Data to the GPU machine, which has no package index: they travel in the
working tree (the device tool's `carry`), whose limit is 64 MiB in all.

    python scripts/ray_wheels.py [--dest .whl]     # here, in the repository root (.whl/ git-ignored)

The GPU image (Python 3.12, x86-64) already has what ray[data] needs but ray itself and jsonschema
(numpy, pandas, pyarrow, fsspec, protobuf, msgpack, click, filelock, packaging, pyyaml, requests,
attrs): WHEELS lists the missing ones. ray's wheel is 79 MB, so its ray/jars folder (31 MB
compressed: the jars of Ray's Java workers, which a Python job never loads) is left out of it,
with its lines in the wheel's RECORD. On the GPU machine, first in the command:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site || exit;
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import zipfile

# name==version of each wheel the GPU image lacks (ray 2.60.0 is the version the tests ran on).
WHEELS = ("ray==2.60.0", "jsonschema==4.26.0", "jsonschema-specifications==2025.9.1", "referencing==0.37.0",
          "rpds-py==0.30.0")
# The GPU machine's interpreter and platform tags, for pip download.
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
# What is cut out of ray's wheel (a path prefix inside it).
RAY_DROPPED = "ray/jars/"


def download(dest: str) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", PYTHON_VERSION, "--implementation", "cp", *platforms, "-d", dest, *WHEELS],
                   check=True)


def drop_from_wheel(path: str, prefix: str) -> int:
    """Rewrite the wheel at `path` without the files under `prefix` (and their RECORD lines);
    returns how many bytes it saved."""
    before = os.path.getsize(path)
    tmp = path + ".tmp"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename.startswith(prefix):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not line.startswith(prefix)).encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    os.replace(tmp, path)
    return before - os.path.getsize(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dest", default=".whl")
    args = ap.parse_args()
    download(args.dest)
    ray_wheel = [f for f in os.listdir(args.dest) if f.startswith("ray-") and f.endswith(".whl")]
    if len(ray_wheel) != 1:
        sys.exit(f"expected one ray wheel in {args.dest}, found {ray_wheel}")
    with zipfile.ZipFile(os.path.join(args.dest, ray_wheel[0])) as z:
        slim = not any(name.startswith(RAY_DROPPED) for name in z.namelist())
    if not slim:
        saved = drop_from_wheel(os.path.join(args.dest, ray_wheel[0]), RAY_DROPPED)
        print(f"{ray_wheel[0]}: {RAY_DROPPED} left out ({saved / 2**20:.1f} MiB)")
    total = 0
    for name in sorted(os.listdir(args.dest)):
        size = os.path.getsize(os.path.join(args.dest, name))
        total += size
        print(f"{size / 2**20:8.2f} MiB  {name}")
    print(f"{total / 2**20:8.2f} MiB  in all")


if __name__ == "__main__":
    main()
