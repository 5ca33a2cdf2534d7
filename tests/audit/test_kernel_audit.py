#!/usr/bin/env python3
"""Self-test of scripts/kernel-audit.py on PTX that nvcc wrote (tests/audit/audit_selftest.cu):
the clean build passes, the fast-math build fails naming each kernel and each kind of instruction
the CPU does not perform, and a damaged input is refused.

  test_kernel_audit.py AUDIT CLEAN.ptx FAST.ptx
"""
import os
import subprocess
import sys
import tempfile


def run(*args):
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def main():
    audit, clean, fast = sys.argv[1:4]
    failures, checks = [], [0]

    def check(cond, what, out):
        checks[0] += 1
        if not cond:
            failures.append(f"{what}\n--- audit output ---\n{out}")

    code, out = run(audit, "ptx", clean)
    check(code == 0 and ": clean" in out, "the exact-mode build of the self-test kernels must pass", out)

    code, out = run(audit, "ptx", fast)
    check(code == 1, "the fast-math build must fail (exit 1)", out)
    lines = out.splitlines()

    def flagged(kernel, words):
        return any(kernel in l and all(w in l for w in words) for l in lines)

    check(flagged("multiply_add", ["fma.rn", "does not call fma"]), "the contraction a*b+c is named", out)
    check(flagged("approximations", ["ex2.approx"]), "__expf (ex2.approx) is named", out)
    check(flagged("approximations", ["lg2.approx"]), "__logf (lg2.approx) is named", out)
    check(flagged("approximations", ["sin.approx"]), "__sinf (sin.approx) is named", out)
    check(flagged("approximations", ["rsqrt.approx"]), "rsqrtf is named", out)
    check(flagged("divide_and_root", ["div."]), "the fast-math division is named", out)
    check(flagged("divide_and_root", ["sqrt.approx"]), "the fast-math square root is named", out)
    check(not any("explicit_fma" in l and "does not call fma" in l for l in lines),
          "an fma the source calls is not a contraction", out)

    with tempfile.TemporaryDirectory() as d:
        empty = os.path.join(d, "empty.ptx")
        open(empty, "w").close()
        code, out = run(audit, "ptx", empty)
        check(code == 2 and "no instructions" in out, "an empty file is refused (exit 2)", out)
        code, out = run(audit, "ptx", os.path.join(d, "missing.ptx"))
        check(code == 2 and "missing.ptx" in out, "a missing file is named (exit 2)", out)

    for f in failures:
        print("FAILED:", f)
    print(f"kernel-audit self-test: {len(failures)} of {checks[0]} checks failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
