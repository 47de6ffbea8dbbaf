#!/usr/bin/env python3
"""Checks Strata's TensorBoard event files with TensorBoard's own reader.

read_events.py WRITER: runs WRITER (monitor_write_events) into a temporary folder, loads the
folder with tensorboard's EventAccumulator and compares every scalar (tag, step, float32 value)
with what the writer says it wrote. Exits 77 (CTest's SKIP_RETURN_CODE) when the `tensorboard`
package is not installed: it is a check from outside, never a dependency of Strata.
"""
import math
import os
import struct
import subprocess
import sys
import tempfile

SKIP = 77


def as_float32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def main():
    try:
        from tensorboard.backend.event_processing import event_accumulator
    except ImportError as e:
        print(f"SKIP: tensorboard is not installed for {sys.executable} ({e}); `pip install tensorboard`")
        return SKIP

    writer = sys.argv[1]
    with tempfile.TemporaryDirectory() as out:
        run = subprocess.run([writer, out, "job"], check=True, capture_output=True, text=True)
        expected = {}
        event_file = None
        for line in run.stdout.splitlines():
            fields = line.split("\t")
            if fields[0] == "file":
                event_file = fields[1]
                continue
            tag, value, step = fields
            expected.setdefault(tag, []).append((int(step), as_float32(float(value))))

        log_dir = os.path.join(out, "job")
        files = [f for f in os.listdir(log_dir) if "tfevents" in f]
        assert files == [os.path.basename(event_file)], (files, event_file)

        acc = event_accumulator.EventAccumulator(log_dir, size_guidance={event_accumulator.SCALARS: 0})
        acc.Reload()
        assert acc.file_version == 2.0, acc.file_version
        tags = sorted(acc.Tags()["scalars"])
        assert tags == sorted(expected), (tags, sorted(expected))
        for tag in tags:
            got = [(s.step, s.value) for s in acc.Scalars(tag)]
            assert got == expected[tag], (tag, got, expected[tag])
            for s in acc.Scalars(tag):
                assert math.isfinite(s.wall_time) and s.wall_time > 1.5e9, s.wall_time
        n = sum(len(v) for v in expected.values())
        print(f"tensorboard {__import__('tensorboard').__version__} read {n} scalars in {len(tags)} tags "
              f"from {os.path.basename(event_file)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
