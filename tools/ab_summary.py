"""TFLOP/s of the harnesses' `bench` logs, new against base (`tools/gpu.sh ab`): per shape the median over
the logs (passes) of each side, then the ratio new / base, and the median ratio per (dtype, head dim, causal).

    python3 tools/ab_summary.py --new new_p1.log new_p2.log --base base_p1.log base_p2.log [--shapes] [--dims 64]
"""
import argparse
import statistics


def load(paths):
    """{(dtype, d, causal, batch, seqlen): [TFLOP/s per log]}: the forward's columns `dtype d causal batch
    seqlen ... TFLOP/s kernel` and the backward's markdown rows `| dtype | d | causal | batch | seqlen | heads
    | ... | TFLOP/s |`."""
    rows = {}
    for path in paths:
        for line in open(path):
            table = line.startswith("|")
            f = [c.strip() for c in line.strip().strip("|").split("|")] if table else line.split()
            if len(f) < 9 or f[0] not in ("bf16", "fp16") or not f[1].isdigit():
                continue
            causal = {"no": "0", "yes": "1"}.get(f[2], f[2])
            rate = f[-1] if table else f[-2]
            rows.setdefault((f[0], f[1], causal, f[3], f[4]), []).append(float(rate))
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--new", nargs="+", required=True)
    parser.add_argument("--base", nargs="+", required=True)
    parser.add_argument("--shapes", action="store_true", help="also print every shape's ratio")
    parser.add_argument("--dims", nargs="+", default=None, help="only these head dims")
    args = parser.parse_args()
    new, base = load(args.new), load(args.base)
    groups = {}
    for shape in sorted(set(new) & set(base)):
        if args.dims and shape[1] not in args.dims:
            continue
        ratio = statistics.median(new[shape]) / statistics.median(base[shape])
        groups.setdefault(shape[:3], []).append(ratio)
        if args.shapes:
            print(f"  {' '.join(shape):28s} base {statistics.median(base[shape]):7.1f}  "
                  f"new {statistics.median(new[shape]):7.1f}  {ratio:.3f}")
    print("dtype    d causal  median ratio (shapes)")
    for (dtype, d, causal), ratios in sorted(groups.items()):
        print(f"{dtype:5s} {d:>4s} {causal:>6s}  {statistics.median(ratios):.3f} ({len(ratios)})")
    every = [r for ratios in groups.values() for r in ratios]
    if every:
        print(f"all                {statistics.median(every):.3f} ({len(every)})")


if __name__ == "__main__":
    main()
