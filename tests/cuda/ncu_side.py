#!/usr/bin/env python3
"""ncu_side.py A.txt B.txt ...: the metrics of ncu's text reports (one kernel each, the
default page output of --section ...) side by side, one row a metric, in the first report's
order. Used by `run_gpu.sh profile-peer` (ours against cuDNN on one decode shape)."""
import re
import sys

ROW = re.compile(r"^\s{4}(\S.*?)\s{2,}(\S+)?\s+([-\d.,]+)$")


def metrics(path):
    """(kernel name, {metric: value unit}) of the first kernel in an ncu text report."""
    name, out = None, {}
    with open(path, errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if name is None and re.match(r"^\s{2}\S.*\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)", line):
                head = re.split(r"\s\(\d+, \d+, \d+\)x", line.strip())[0]
                m = re.search(r"(\w+)[<(]", head)
                name = (m.group(1) if m else head.split()[0])[:48]
                continue
            m = ROW.match(line)
            if name is not None and m and m.group(1) not in out:
                unit = m.group(2) or ""
                out[m.group(1).strip()] = f"{m.group(3)} {unit}".strip()
    return name, out


def main():
    reports = [metrics(p) for p in sys.argv[1:]]
    if not reports or any(not r[1] for r in reports):
        for p, r in zip(sys.argv[1:], reports):
            if not r[1]:
                print(f"ncu_side: no metrics in {p}", file=sys.stderr)
        return 1
    keys = list(reports[0][1])
    for _, m in reports[1:]:
        keys += [k for k in m if k not in keys]
    print("| metric | " + " | ".join(r[0] or "?" for r in reports) + " |")
    print("|---" * (len(reports) + 1) + "|")
    for k in keys:
        print(f"| {k} | " + " | ".join(m.get(k, "-") for _, m in reports) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
