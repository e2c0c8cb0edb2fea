"""Median TFLOP/s ratio new / base per A/B folder (harness bench logs, head dim 64, 512..16k tokens)."""
import pathlib
import statistics


def load(path):
    rows = {}
    for line in open(path):
        f = line.split()
        if len(f) >= 9 and f[0] in ("bf16", "fp16"):
            rows[(f[0], f[1], f[2], f[4])] = float(f[-2])
    return rows


here = pathlib.Path(__file__).parent
for ab in sorted(p for p in here.iterdir() if p.is_dir()):
    cells = []
    for log, family in (("bench.log", "sm90"), ("bench80.log", "sm80")):
        new, base = load(ab / "new" / log), load(ab / "base" / log)
        ratios = [new[k] / base[k] for k in new if k in base and k[1] == "64"]
        cells.append(f"{family} {statistics.median(ratios):.3f} ({len(ratios)} shapes)")
    print(f"| {ab.name} | " + " | ".join(cells) + " |")
