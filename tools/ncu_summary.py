"""Sums ncu's per-instruction CSVs (`--page source --csv --print-source sass`, one kernel each): the warp stall
samples by reason and by opcode, the busiest instructions, and the share of samples in code run once per query
tile or less (the prologue, the first S, the last P V, the epilogue) against the per-key-tile loop, told apart by
each instruction's execution count: the loop's HGMMAs run once per key tile, so code run at most a quarter as often
as the busiest HGMMA is per-tile code.

    python3 tools/ncu_summary.py ncu_NAME_sass.csv.gz ...   (`tools/gpu.sh harness ncu` runs it on the GPU machine)
"""
import collections
import csv
import gzip
import io
import sys


def summarize(path):
    text = gzip.open(path, "rt").read()
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:  # ncu wrote no source page (its run failed): say so, go on with the next file
        print(f"== {path.split('/')[-1]}: no per-instruction table")
        return
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    kernel = lines[0].split('","')[-1][:110] if start else ""
    number = lambda row, key: float((row.get(key) or "0").replace(",", "") or 0)
    samples = [number(r, "Warp Stall Sampling (All Samples)") for r in rows]
    executed = [number(r, "Instructions Executed") for r in rows]
    total = sum(samples) or 1.0
    opcode = lambda r: next((t for t in r["Source"].split() if not t.startswith("@")), "?").split(".")[0]
    print(f"== {path.split('/')[-1]}  {kernel}\n{int(total)} samples, {int(sum(executed))} warp instructions")

    reasons = collections.Counter()
    for r in rows:
        for key, value in r.items():
            if key.startswith("stall_") and "Not Issued" not in key:
                reasons[key[6:]] += number(r, key)
    print("by reason: " + ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in reasons.most_common(9)))

    by_op, by_op_exec = collections.Counter(), collections.Counter()
    for r, s, e in zip(rows, samples, executed):
        by_op[opcode(r)] += s
        by_op_exec[opcode(r)] += e
    all_exec = sum(executed) or 1.0
    print("by opcode (samples / executed): " + ", ".join(
        f"{k} {100 * v / total:.1f}/{100 * by_op_exec[k] / all_exec:.1f}%" for k, v in by_op.most_common(12)))

    loop_count = max((e for r, e in zip(rows, executed) if opcode(r) == "HGMMA"), default=0)
    per_tile = sum(s for s, e in zip(samples, executed) if 0 < e <= loop_count / 4)
    print(f"per-tile code (executed <= 1/4 of the busiest HGMMA's {int(loop_count)}): {100 * per_tile / total:.1f}% "
          f"of the samples, {100 * sum(e for e in executed if 0 < e <= loop_count / 4) / all_exec:.1f}% of the "
          "instructions")
    print("busiest instructions:")
    for i in sorted(range(len(rows)), key=lambda i: -samples[i])[:10]:
        r = rows[i]
        top = max((k for k in r if k.startswith("stall_") and "Not Issued" not in k), key=lambda k: number(r, k))
        print(f"  {100 * samples[i] / total:5.1f}%  x{int(executed[i]):>9}  {r['Source'].strip()[:70]:70}  {top[6:]}")


for path in sys.argv[1:]:
    summarize(path)
    print()
