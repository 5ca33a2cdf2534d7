"""Fixtures shared by the tests of the Python package: the dsv4 CLI (the C++ side every test compares
with) and small traces it recorded. ctest sets DSV4_CLI and PYTHONPATH (python/CMakeLists.txt); run by
hand, the defaults point into build/ of the checkout."""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CLI = os.environ.get("DSV4_CLI", str(ROOT / "build" / "cli" / "dsv4"))
TOKENS = 24  # a short sequence: C4 layers have 6 compressed groups, enough for top-k widths > 1


def cli(*args, check=True):
    """Run the dsv4 CLI; returns the CompletedProcess (text)."""
    p = subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, env={**os.environ, "OMP_WAIT_POLICY": "passive"})
    if check and p.returncode != 0:
        raise AssertionError("dsv4 {} exited {}:\n{}{}".format(" ".join(map(str, args)), p.returncode, p.stdout, p.stderr))
    return p


def cli_json(*args):
    return json.loads(cli(*args).stdout)


@pytest.fixture(scope="session")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("dsv4")


def _record(work, profile, capture):
    out = work / "{}-{}.h5".format(profile, capture.replace("*", "x").replace(",", "_"))
    if not out.exists():
        cli("record", "--preset", "tiny", "--seed", 7, "--random", TOKENS, "--profile", profile, "--capture",
            capture, "--out", out)
    return out


@pytest.fixture(scope="session")
def train_trace(work):
    """A C++-written trace of one train step, every named tensor kept."""
    return _record(work, "train", "full")


@pytest.fixture(scope="session")
def rollout_trace(work):
    return _record(work, "rollout", "decisions")


@pytest.fixture(scope="session")
def tiny_config(train_trace):
    import dsv4
    return dsv4.open_trace(train_trace).model["config"]
