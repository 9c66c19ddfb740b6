#!/usr/bin/env python3
"""Compares the kernels of two PTX files of prefill_sm90.cu (or any file of templated
__global__ kernels), entry by entry, without a GPU: a refactor that leaves a kernel's PTX body
the same leaves its bits and, short of ptxas's own choices, its speed (NOTES.md v5.17).

Kernels are matched by their template arguments (the mangled name's I...E list); names, the
anonymous namespace's hash and basic-block numbers are normalised away. With --strip IDX=VAL,
a NEW kernel whose template argument IDX is VAL is compared with the OLD kernel that has the
other arguments (a template flag added since OLD). Prints per kernel: same, same with virtual
registers erased (the same instructions, registers numbered differently), or different; exits
1 if any differ.

  nvcc -std=c++17 --fmad=false --generate-code=arch=compute_90a,code=sm_90a \\
       -I. -I.. -I../../plugin/include -ptx prefill_sm90.cu -o new.ptx   (in kernels/cuda)
  tests/cuda/ptx_compare.py old.ptx new.ptx [--strip 6=0]
"""
import argparse
import re
import sys

ENTRY = re.compile(r"^(?:\.visible )?\.entry (\S+)\($")
REG = re.compile(r"%(rd|r|f|fd|p|rs|h|hh)\d+\b")


def entries(path):
    """{template args: (name, body lines)} of the file's kernels."""
    lines = open(path).read().split("\n")
    out, i = {}, 0
    while i < len(lines):
        m = ENTRY.match(lines[i])
        if not m:
            i += 1
            continue
        name, j = m.group(1), i + 1
        while not lines[j].startswith(")"):
            j += 1  # the parameter list: compared through its uses in the body
        k = j + 1
        while k < len(lines) and not ENTRY.match(lines[k]) and not lines[k].startswith("\t// .globl"):
            k += 1
        t = re.search(r"I(L.*?)EEv", name)
        key = tuple(int(x) for x in re.findall(r"L[ib](\d+)", t.group(1))) if t else (name,)
        out[key] = (name, lines[j:k])
        i = k
    return out


def norm(name, body):
    s = "\n".join(body).replace(name, "K")
    s = re.sub(r"_GLOBAL__N__[0-9a-f]+_", "NS_", s)
    return re.sub(r"\$L__BB\d+_", "$L__BB_", s)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--strip", action="append", default=[], help="IDX=VAL: a template argument added since OLD")
    args = ap.parse_args()
    strip = [tuple(int(x) for x in s.split("=")) for s in args.strip]
    old, new = entries(args.old), entries(args.new)
    bad = 0
    for key, (name, body) in sorted(new.items(), key=lambda kv: str(kv[0])):
        okey = key
        for idx, val in strip:
            if len(okey) > idx:
                okey = okey[:idx] + okey[idx + 1:] if key[idx] == val else None
            if okey is None:
                break
        if okey is None:
            print(f"{key}: new only (template argument {strip})")
            continue
        if okey not in old:
            print(f"{key}: not in {args.old}")
            bad += 1
            continue
        a, b = norm(old[okey][0], old[okey][1]), norm(name, body)
        if a == b:
            verdict = "same"
        elif REG.sub("%R", a) == REG.sub("%R", b):
            verdict = "same with registers erased"
        else:
            verdict = "DIFFERENT"
            bad += 1
        print(f"{key}: {verdict}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
