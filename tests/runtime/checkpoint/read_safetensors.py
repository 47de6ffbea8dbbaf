#!/usr/bin/env python3
"""Checks Strata's safetensors files against the reference `safetensors` package, both ways.

read_safetensors.py TOOL (checkpoint_tool):
  1. `TOOL st-write F` writes F and prints what it wrote; safetensors.deserialize(F) must give
     the same names, dtypes, shapes and bytes, and safe_open(F).metadata() the same metadata.
  2. safetensors.serialize_file writes G (every dtype, the reference's own ordering and header
     padding); `TOOL st-read G` must print what was put in.
Exits 77 (CTest's SKIP_RETURN_CODE) when the package is not installed: it is a check from
outside, never a dependency of Strata.
"""
import json
import os
import random
import subprocess
import sys
import tempfile

SKIP = 77
# Strata's dtype names -> the reference package's TensorSpec names, and element sizes.
DTYPES = {"BOOL": ("bool", 1), "U8": ("uint8", 1), "I8": ("int8", 1), "I16": ("int16", 2),
          "I32": ("int32", 4), "I64": ("int64", 8), "F16": ("float16", 2),
          "BF16": ("bfloat16", 2), "F32": ("float32", 4), "F64": ("float64", 8),
          "C64": ("complex64", 8)}


def parse(stdout):
    tensors, meta = {}, {}
    for line in stdout.splitlines():
        fields = line.split("\t")
        if fields[0] == "tensor":
            _, name, dtype, shape, hexdata = fields
            tensors[name] = (dtype, json.loads(shape), bytes.fromhex(hexdata))
        elif fields[0] == "meta":
            meta[fields[1]] = fields[2]
    return tensors, meta


def fail(msg):
    print("FAIL:", msg)
    sys.exit(1)


def check_strata_file(tool, path):
    run = subprocess.run([tool, "st-write", path], check=True, capture_output=True, text=True)
    expected, expected_meta = parse(run.stdout)
    with open(path, "rb") as f:
        blob = f.read()
    got = {name: (v["dtype"], list(v["shape"]), bytes(v["data"]))
           for name, v in safetensors.deserialize(blob)}
    if set(got) != set(expected):
        fail(f"names differ: {sorted(got)} vs {sorted(expected)}")
    for name, want in expected.items():
        if got[name] != want:
            fail(f"tensor {name!r}: reference reads {got[name][:2]}, Strata wrote {want[:2]}"
                 " (or the bytes differ)")
    try:
        import numpy  # noqa: F401  (safe_open needs a framework to open the file)
        with safetensors.safe_open(path, framework="numpy") as f:
            if f.metadata() != expected_meta:
                fail(f"metadata {f.metadata()} vs {expected_meta}")
    except ImportError:
        print("note: numpy missing, metadata not checked through safe_open")
    print(f"ok: the reference reads Strata's file ({len(expected)} tensors, {len(blob)} bytes)")


def spec(dtype, shape, buf):
    name, _ = DTYPES[dtype]
    if hasattr(safetensors, "TensorSpec"):  # 0.8+: raw pointers
        import ctypes
        keep = ctypes.create_string_buffer(bytes(buf), max(len(buf), 1))
        spec._keep.append(keep)
        return safetensors.TensorSpec(dtype=name, shape=shape, data_ptr=ctypes.addressof(keep),
                                      data_len=len(buf))
    return {"dtype": name, "shape": shape, "data": bytes(buf)}


spec._keep = []


def check_reference_file(tool, path):
    rng = random.Random(11)
    want = {}
    for i, (dtype, (_, size)) in enumerate(DTYPES.items()):
        shape = [rng.randint(1, 4), rng.randint(1, 3)] if i % 2 else [rng.randint(1, 7)]
        n = 1
        for d in shape:
            n *= d
        if dtype == "BOOL":
            buf = bytes(rng.randint(0, 1) for _ in range(n))
        elif dtype in ("F16", "BF16", "F32", "F64", "C64"):
            # finite values: random mantissas, exponents near 1
            import struct
            if dtype == "F64":
                buf = b"".join(struct.pack("<d", rng.uniform(-4, 4)) for _ in range(n))
            elif dtype in ("F32", "C64"):
                buf = b"".join(struct.pack("<f", rng.uniform(-4, 4)) for _ in range(n * size // 4))
            elif dtype == "BF16":
                buf = b"".join(struct.pack("<f", rng.uniform(-4, 4))[2:] for _ in range(n))
            else:
                buf = b"".join(struct.pack("<e", rng.uniform(-4, 4)) for _ in range(n))
        else:
            buf = bytes(rng.randrange(256) for _ in range(n * size))
        want[f"w.{dtype.lower()}"] = (dtype, shape, buf)
    want["empty"] = ("F32", [0, 3], b"")
    want["scalar"] = ("I64", [], (123456789).to_bytes(8, "little", signed=True))
    meta = {"source": "python safetensors", "note": "tab-free"}
    safetensors.serialize_file({k: spec(*v) for k, v in want.items()}, path, metadata=meta)
    run = subprocess.run([tool, "st-read", path], capture_output=True, text=True)
    if run.returncode != 0:
        fail(f"Strata cannot read the reference's file: {run.stderr.strip()}")
    got, got_meta = parse(run.stdout)
    if got != want:
        diff = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
        fail(f"Strata reads the reference's file differently: {diff}")
    if got_meta != meta:
        fail(f"metadata {got_meta} vs {meta}")
    print(f"ok: Strata reads the reference's file ({len(want)} tensors)")


def main():
    global safetensors
    try:
        import safetensors
    except ImportError as e:
        print(f"SKIP: safetensors is not installed for {sys.executable} ({e}); "
              "`pip install safetensors`")
        return SKIP
    print(f"safetensors {getattr(safetensors, '__version__', '?')}")
    tool = sys.argv[1]
    with tempfile.TemporaryDirectory() as out:
        check_strata_file(tool, os.path.join(out, "strata.safetensors"))
        check_reference_file(tool, os.path.join(out, "reference.safetensors"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
