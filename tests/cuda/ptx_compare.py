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
  tests/cuda/ptx_compare.py --self-test      (ctest cuda_ptx_compare: made-up PTX, no nvcc)
"""
import argparse
import re
import sys

ENTRY = re.compile(r"^(?:\.visible )?\.entry (\S+)\($")
REG = re.compile(r"%(rd|r|f|fd|p|rs|h|hh)\d+\b")
NS = re.compile(r"_GLOBAL__N__[0-9a-f]+_")  # the anonymous namespace's hash, per file path


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
        key = tuple(int(x) for x in re.findall(r"L[ib](\d+)", t.group(1))) if t else (NS.sub("", name),)
        out[key] = (name, lines[j:k])
        i = k
    return out


def norm(name, body):
    s = "\n".join(body).replace(name, "K")
    s = NS.sub("NS_", s)
    return re.sub(r"\$L__BB\d+_", "$L__BB_", s)


def compare(old, new, strip, old_name="old"):
    """[(key, verdict)] of new's kernels against old's and the count of differing ones."""
    out, bad = [], 0
    for key, (name, body) in sorted(new.items(), key=lambda kv: str(kv[0])):
        okey = key
        for idx, val in strip:
            if len(okey) > idx:
                okey = okey[:idx] + okey[idx + 1:] if key[idx] == val else None
            if okey is None:
                break
        if okey is None:
            out.append((key, f"new only (template argument {strip})"))
            continue
        if okey not in old:
            out.append((key, f"not in {old_name}"))
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
        out.append((key, verdict))
    return out, bad


def self_test():
    """The verdicts on made-up kernels: a renamed copy, a register renumbering, a change and
    a kernel of a new template flag."""
    import os
    import tempfile

    def kernel(ns, args, n, add, r):
        name = f"_ZN48_GLOBAL__N__{ns}_15_x_cu_0f85615214kI{''.join(f'Lb{a}E' for a in args)}EEv"
        return (f".visible .entry {name}(\n\t.param .u32 {name}_param_0\n)\n{{\n"
                f"\tld.param.u32 %r{r}, [{name}_param_0];\n$L__BB{n}_1:\n"
                f"\tadd.s32 %r{r + 1}, %r{r}, {add};\n\tbra $L__BB{n}_1;\n}}\n")

    old = kernel("aaaa1111", (0, 0), 3, 1, 1) + kernel("aaaa1111", (0, 1), 4, 1, 1) + kernel("aaaa1111", (1, 0), 5, 1, 1)
    new = (kernel("bbbb2222", (0, 0, 0), 7, 1, 1) + kernel("bbbb2222", (0, 1, 0), 8, 1, 7) +
           kernel("bbbb2222", (1, 0, 0), 9, 2, 1) + kernel("bbbb2222", (1, 0, 1), 6, 2, 1))
    with tempfile.TemporaryDirectory() as d:
        paths = [os.path.join(d, "old.ptx"), os.path.join(d, "new.ptx")]
        open(paths[0], "w").write(old)
        open(paths[1], "w").write(new)
        got, bad = compare(entries(paths[0]), entries(paths[1]), [(2, 0)])
    want = [((0, 0, 0), "same"), ((0, 1, 0), "same with registers erased"), ((1, 0, 0), "DIFFERENT"),
            ((1, 0, 1), "new only (template argument [(2, 0)])")]
    if got != want or bad != 1:
        print(f"self-test: got {got}, {bad} differing; want {want}, 1")
        return 1
    print("self-test: 4 verdicts as expected")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", nargs="?")
    ap.add_argument("new", nargs="?")
    ap.add_argument("--strip", action="append", default=[], help="IDX=VAL: a template argument added since OLD")
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    if args.self_test:
        sys.exit(self_test())
    if args.new is None:
        ap.error("OLD and NEW PTX files")
    strip = [tuple(int(x) for x in s.split("=")) for s in args.strip]
    out, bad = compare(entries(args.old), entries(args.new), strip, args.old)
    for key, verdict in out:
        print(f"{key}: {verdict}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
