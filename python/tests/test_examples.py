"""The examples: write_trace.py runs and writes a valid trace; torch_hook.py compiles, and where PyTorch
is installed (python3-torch; not a dependency) records a stand-in model whose modules answer like the
reference inference code's."""

import importlib.util
import py_compile
import subprocess
import sys

import numpy as np
import pytest

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


def test_torch_hook_example_records_what_the_modules_returned(work, tmp_path):
    """torch_hook.record on a stand-in model whose modules are named and answer like the reference
    inference code's: the trace holds what the hooks saw, as sets, and the log-probs of the forward
    (torch_hook_check.py, in its own process: importing torch changes the process's OpenMP threads,
    which the other tests compare with the CLI's)."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("PyTorch is not installed (python3-torch)")
    model_dir = work / "torch-hook-model"
    cli("model", "init", "--preset", "tiny", "--seed", 5, "--out", model_dir)
    out = tmp_path / "torch.h5"
    p = subprocess.run([sys.executable, str(ROOT / "python" / "tests" / "torch_hook_check.py"), str(EXAMPLES),
                        str(model_dir / "config.json"), str(out)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert cli("trace", "validate", out, check=False).returncode == 0
