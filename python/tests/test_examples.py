"""The examples: write_trace.py runs and writes a valid trace; torch_hook.py at least compiles (torch
is not a dependency)."""

import py_compile
import subprocess
import sys

import numpy as np

import dsv4
from conftest import ROOT, cli

EXAMPLES = ROOT / "python" / "examples"


def test_write_trace_example(work, tmp_path):
    model = work / "example-model"
    cli("model", "init", "--preset", "tiny", "--seed", 3, "--out", model)
    out = tmp_path / "example.h5"
    p = subprocess.run([sys.executable, str(EXAMPLES / "write_trace.py"), str(out), str(model / "config.json")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert cli("trace", "validate", out, check=False).returncode == 0
    step = dsv4.open_trace(out).step(0)
    assert (step.engine, step.profile, step.complete, len(step)) == ("numpy-example", "rollout", True, 2)
    seq = step.seq(1)
    assert (seq.id, seq.prompt_length) == ("request-1", 16)
    k = dsv4.open_trace(out).model["config"]["num_experts_per_tok"]
    assert np.all(seq.routing(0)["weights"] == np.float32(1.0 / k))


def test_torch_hook_example_compiles(tmp_path):
    py_compile.compile(str(EXAMPLES / "torch_hook.py"), cfile=str(tmp_path / "torch_hook.pyc"), doraise=True)
