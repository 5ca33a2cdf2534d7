#!/usr/bin/env python3
"""Proves that the exact-mode CUDA kernels compute what the CPU reference computes, on every GPU
architecture: no floating-point instruction may round, approximate or fuse differently from the
CPU.

  kernel-audit.py ptx FILE.ptx...           audit PTX (what nvcc emits for each virtual architecture)
  kernel-audit.py sass SASS.txt --ptx F...  audit `cuobjdump -sass` output of a binary against the
                                            PTX of the same sources

PTX is where the proof lives. Every later step (ptxas for each real architecture, the driver's JIT
of embedded PTX) translates PTX instructions with fixed IEEE semantics; what is not pinned down in
PTX is what the audit refuses:
  - add/sub/mul on floating types without a rounding modifier: ptxas may contract them into an fma
    (PTX ISA, "mul": "mul/add sequences with no rounding modifiers may be optimized to use fused
    multiply-add"); nvcc --fmad=false writes .rn on each, so an fma happens only where the source
    calls fma(), as on the CPU;
  - .approx, .ftz, .sat, .relu, and ex2, lg2, sin, cos, tanh, rsqrt (all approximations);
  - div, sqrt, rcp, fma without .rn (IEEE round-to-nearest-even is what the CPU does);
  - an fma whose source line (PTX compiled with -lineinfo) does not call fma: a contraction by the
    compiler, a*b+c computed with one rounding where the CPU rounds twice;
  - tensor-core instructions (mma, wmma, wgmma): their accumulation order is not the CPU's. The one
    exception is a function whose (mangled) name contains "tensor_core": the kernels of the
    tensor_core reduction order (fast numerics, kernels/cuda/linear_tc.cu), which the CPU never
    computes (it refuses that order); every other rule applies to them too.
The SASS audit checks the other end: no MUFU approximation other than the reciprocal and reciprocal
square root that start ptxas's exact division and square-root sequences (IEEE div.rn, sqrt.rn and
rcp.rn, and integer div and rem; allowed only in functions whose PTX has one), no tensor-core
instruction. .FTZ forms are not refused in SASS:
ptxas uses them inside its IEEE division and square-root sequences on operands it has scaled away
from the denormal range, and in float-to-integer conversions and comparisons where the result is the
same; PTX without .ftz (checked above) binds it to denormal-preserving results.

Exit 0 when clean; 1 with one line per offending instruction (file, line, function, instruction).
"""
import argparse
import re
import subprocess
import sys

FLOAT_TYPES = {"f16", "f16x2", "bf16", "bf16x2", "f32", "f64"}
ROUNDING = {"rn", "rz", "rm", "rp"}
APPROXIMATIONS = {"ex2", "lg2", "sin", "cos", "tanh", "rsqrt"}
BAD_MODIFIERS = {
    "approx": "approximate",
    "ftz": "flushes denormals to zero (the CPU keeps them)",
    "sat": "saturates to [0, 1]",
    "relu": "clamps at zero",
    "full": "division to 2 ulp, not IEEE",
}
TENSOR_CORE = {"mma", "wmma", "wgmma"}
NEEDS_RN = {"div", "sqrt", "rcp", "fma", "mad"}

_ENTRY = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+|\.extern\s+)*\.(?:entry|func)\s+(?:\([^)]*\)\s*)?([\w$]+)")
_INSTR = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][a-z0-9_]*(?:\.[a-z0-9_]+)*)\b")


def demangle(names):
    names = sorted(set(names))
    if not names:
        return {}
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
        return dict(zip(names, out.stdout.splitlines()))
    except (OSError, subprocess.CalledProcessError):
        return {n: n for n in names}


TENSOR_CORE_FUNCTION = "tensor_core"  # in a function's name: its tensor-core instructions are its order


def ptx_problems(op, func=""):
    """Why the PTX instruction `op` (e.g. 'add.rn.f32') may differ from the CPU: a list, empty if it may not."""
    parts = op.split(".")
    base, mods = parts[0], set(parts[1:])
    if base in TENSOR_CORE:
        if TENSOR_CORE_FUNCTION in func:
            return []
        return ["tensor-core accumulation (its order is not the CPU's)"]
    floating = bool(mods & FLOAT_TYPES)
    why = []
    if base in APPROXIMATIONS and floating:
        why.append("hardware approximation (the CPU uses kernels/numerics)")
    for m in sorted(mods & BAD_MODIFIERS.keys()):
        if (floating or m in ("approx", "ftz")) and not (m == "approx" and why):
            why.append(BAD_MODIFIERS[m])
    if floating and base in ("add", "sub", "mul") and not mods & ROUNDING:
        why.append("no rounding modifier: ptxas may contract it into an fma")
    if floating and base in NEEDS_RN and "rn" not in mods:
        why.append("not IEEE round-to-nearest-even")
    return why


_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]+)"')
_LOC = re.compile(r"^\s*\.loc\s+(\d+)\s+(\d+)\s+\d+")
_sources = {}


def source_line(path, line):
    if path not in _sources:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                _sources[path] = f.read().split("\n")
        except OSError:
            _sources[path] = None
    text = _sources[path]
    return text[line - 1] if text and 0 < line <= len(text) else None


def audit_ptx(path):
    """Returns (problems, functions with a division, remainder, sqrt or reciprocal, instruction count)."""
    problems, exact_seq, count, func, loc = [], set(), 0, "?", None
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    files = {}
    for line in lines:  # .file directives come after the code that names them
        m = _FILE.match(line)
        if m:
            files[m.group(1)] = m.group(2)
    for lineno, line in enumerate(lines, 1):
        code = line.split("//", 1)[0]
        m = _ENTRY.match(code)
        if m:
            func, loc = m.group(1), None
            continue
        m = _LOC.match(code)
        if m:
            loc = (files.get(m.group(1), "?"), int(m.group(2)))
            continue
        m = _INSTR.match(code)
        if not m or code.lstrip().startswith("."):
            continue
        op = m.group(1)
        count += 1
        parts = op.split(".")
        floating = bool(set(parts[1:]) & FLOAT_TYPES)
        if parts[0] in ("div", "rem") or (parts[0] in ("sqrt", "rcp") and floating):
            exact_seq.add(func)  # ptxas seeds these exact sequences (integer ones too) with MUFU.RCP/RSQ
        why = ptx_problems(op, func)
        if parts[0] in ("fma", "mad") and floating:
            src = source_line(*loc) if loc else None
            if loc is None:
                why.append("fma without line information: compile the PTX with -lineinfo")
            elif src is None:
                why.append(f"fma from {loc[0]}:{loc[1]}, a source line the audit cannot read")
            elif "fma" not in src:
                why.append(f"fma where {loc[0]}:{loc[1]} does not call fma (a contraction): {src.strip()[:80]}")
        if why:
            problems.append((path, lineno, func, op, "; ".join(why)))
    return problems, exact_seq, count


_SASS_FUNC = re.compile(r"^\s*Function\s*:\s*(\S+)")
_SASS_ARCH = re.compile(r"arch\s*=\s*(sm_\w+)")
_SASS_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")
SASS_MUFU_ALLOWED = {"RCP", "RSQ", "RCP64H", "RSQ64H"}  # seeds of the IEEE div/sqrt sequences
SASS_TENSOR = ("HMMA", "IMMA", "DMMA", "HGMMA", "IGMMA", "QGMMA", "UTCHMMA", "UTCQMMA", "UTCIMMA")


def audit_sass(path, exact_seq):
    problems, count, func, arch = [], 0, "?", "?"
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            m = _SASS_ARCH.search(line)
            if m and "/*" not in line:
                arch = m.group(1)
            m = _SASS_FUNC.match(line)
            if m:
                func = m.group(1)
                continue
            m = _SASS_INSTR.search(line)
            if not m:
                continue
            op = m.group(1)
            count += 1
            parts = op.split(".")
            why = None
            if parts[0] == "MUFU":
                kind = parts[1] if len(parts) > 1 else "?"
                if kind not in SASS_MUFU_ALLOWED:
                    why = "hardware approximation MUFU." + kind
                elif func not in exact_seq:
                    why = "MUFU." + kind + " in a function whose PTX has no division, remainder, sqrt or rcp"
            elif parts[0].startswith(SASS_TENSOR) and TENSOR_CORE_FUNCTION not in func:
                why = "tensor-core instruction"
            if why:
                problems.append((path, lineno, f"{func} [{arch}]", op, why))
    return problems, count


def report(problems, what, count, nfiles):
    names = demangle(p[2].split(" ")[0] for p in problems)
    for path, lineno, func, op, why in problems:
        head, _, tail = func.partition(" ")
        shown = names.get(head, head) + ((" " + tail) if tail else "")
        print(f"{path}:{lineno}: {shown}: {op}: {why}")
    verdict = "clean" if not problems else f"{len(problems)} instructions the CPU does not perform"
    print(f"kernel-audit {what}: {count} instructions in {nfiles} files: {verdict}")
    return 1 if problems else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("ptx", help="audit PTX files")
    p.add_argument("files", nargs="+")
    s = sub.add_parser("sass", help="audit cuobjdump -sass output against the PTX of the same sources")
    s.add_argument("sass")
    s.add_argument("--ptx", nargs="+", required=True, help="the PTX files of the same sources")
    a = ap.parse_args()
    try:
        problems, exact_seq, count = [], set(), 0
        for path in (a.files if a.mode == "ptx" else a.ptx):
            pr, seq, n = audit_ptx(path)
            problems += pr
            exact_seq |= seq
            count += n
        if a.mode == "ptx":
            if count == 0:
                print("kernel-audit ptx: no instructions found: is this PTX?", file=sys.stderr)
                return 2
            return report(problems, "ptx", count, len(a.files))
        if problems:
            report(problems, "ptx", count, len(a.ptx))
        sp, n = audit_sass(a.sass, exact_seq)
        if n == 0:
            print(f"kernel-audit sass: no instructions found in {a.sass}: is this cuobjdump -sass output?",
                  file=sys.stderr)
            return 2
        return report(sp, "sass", n, 1) or (1 if problems else 0)
    except OSError as e:
        print(f"kernel-audit: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
