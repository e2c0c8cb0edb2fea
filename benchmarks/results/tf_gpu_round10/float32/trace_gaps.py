"""Where GPU float32's wall time goes when its kernels do not fill it: fwd_bwd_by_dtype.py's timed function
(round 9, imported) under TensorFlow's own profiler (CUPTI: kernels, memcpy and memset with timestamps), then
the trace read back from its XSpace protobuf: how busy the GPU is over the timed calls, its longest idle gaps
and what comes before each, and the host's longest TF ops. (ncu times kernels only, serialized, and the lent
machine has no nsys.) Usage: trace_gaps.py OUT_DIR dtype s b."""
import glob
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tf_gpu_round9", "float32"))

import tensorflow as tf  # noqa: E402
from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: E402

from fwd_bwd_by_dtype import chained, inputs  # noqa: E402


def events(plane):
    names = {k: m.name for k, m in plane.event_metadata.items()}
    for line in plane.lines:
        for e in line.events:
            start = line.timestamp_ns * 1000 + e.offset_ps
            yield line.name, names.get(e.metadata_id, "?"), start, start + e.duration_ps


def report(space):
    for plane in space.planes:
        evs = list(events(plane))
        if not evs:
            continue
        if plane.name.startswith("/device:GPU"):
            by_line = {}
            for line, *_ in evs:
                by_line[line] = by_line.get(line, 0) + 1
            print(f"== {plane.name}: lines {by_line}")
            # Stream lines only (derived lines repeat the same activity): keep lines named like streams.
            stream = [e for e in evs if "Stream" in e[0] or "stream" in e[0]] or evs
            stream.sort(key=lambda e: e[2])
            begin, end = stream[0][2], max(e[3] for e in stream)
            busy, cursor, gaps = 0, begin, []
            prev = None
            for e in stream:
                if e[2] > cursor:
                    gaps.append((e[2] - cursor, prev[1] if prev else "-", e[1]))
                busy += max(0, e[3] - max(e[2], cursor))
                if e[3] > cursor:
                    cursor, prev = e[3], e
            span = end - begin
            print(f"span {span / 1e6:.1f} us, GPU busy {busy / 1e6:.1f} us ({100 * busy / span:.0f}%)")
            by_name = {}
            for e in stream:
                n, t = by_name.get(e[1][:90], (0, 0))
                by_name[e[1][:90]] = (n + 1, t + e[3] - e[2])
            for name, (n, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]:
                print(f"  {t / 1e6:10.1f} us {n:4d}x  {name}")
            print("largest idle gaps (us, after -> before):")
            for g, a, b in sorted(gaps, reverse=True)[:15]:
                print(f"  {g / 1e6:8.1f}  {a[:60]}  ->  {b[:60]}")
        elif plane.name.startswith("/host:CPU"):
            by_name = {}
            for _, name, s, e in evs:
                n, t = by_name.get(name[:90], (0, 0))
                by_name[name[:90]] = (n + 1, t + e - s)
            print(f"== {plane.name}: host events, longest total")
            for name, (n, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:30]:
                print(f"  {t / 1e6:10.1f} us {n:5d}x  {name}")


def main():
    out, dtype, s, b = sys.argv[1], getattr(tf, sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    q, k, v = inputs(dtype, s, b)
    for _ in range(3):
        chained(q, k, v)[0].numpy()
    tf.profiler.experimental.start(out)
    for _ in range(3):
        chained(q, k, v)[0].numpy()
    tf.profiler.experimental.stop()
    space = xplane_pb2.XSpace()
    path = sorted(glob.glob(os.path.join(out, "plugins", "profile", "*", "*.xplane.pb")))[-1]
    space.ParseFromString(open(path, "rb").read())
    print(f"# {sys.argv[2]} s={s} b={b}: 3 calls of `chained` (30 forward+backward steps)")
    report(space)


if __name__ == "__main__":
    main()
