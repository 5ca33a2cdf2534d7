"""dsv4.forward, dsv4.replay and dsv4.diff return the dicts the CLI writes as JSON for the same input."""

import json

import pytest

import dsv4
from conftest import TOKENS, cli, cli_json


def without_seconds(report):
    """A replay report without its timings (the only values that differ between two runs)."""
    if isinstance(report, dict):
        return {k: without_seconds(v) for k, v in report.items() if k != "seconds"}
    if isinstance(report, list):
        return [without_seconds(v) for v in report]
    return report


def test_forward_equals_the_cli():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
    for profile in ("train", "rollout"):
        mine = dsv4.forward(tokens, preset="tiny", seed=7, profile=profile)
        theirs = cli_json("forward", "--preset", "tiny", "--seed", 7, "--tokens", ",".join(map(str, tokens)),
                          "--profile", profile)
        assert mine == theirs
        assert set(mine) == {"profile", "tokens", "logprobs", "indexer_topk", "experts"}
        assert mine["tokens"] == tokens and len(mine["logprobs"]) == len(tokens) - 1


def test_forward_errors():
    with pytest.raises(dsv4.InputError, match="exactly one"):
        dsv4.forward([1, 2, 3])
    with pytest.raises(dsv4.InputError):
        dsv4.forward([1, 2, 10 ** 9], preset="tiny")
    with pytest.raises(dsv4.InputError, match="profile"):
        dsv4.forward([1, 2, 3], preset="tiny", profile="fast")


def test_replay_equals_the_cli(work, train_trace):
    mine = dsv4.replay(train_trace)
    out = work / "replay.json"
    assert cli("replay", train_trace, "--json", out).returncode == 0
    assert without_seconds(mine) == without_seconds(json.loads(out.read_text()))
    assert mine["identical"] and mine["verified_all"] and [s["step"] for s in mine["steps"]] == [0]
    forced = dsv4.replay(train_trace, step=0, force="indexer,routing")
    assert forced["identical"]


def test_replay_tolerance_equals_the_cli(work, train_trace):
    """An exact step replays bit for bit with or without a tolerance (the report says the bound did not
    apply); the report equals `dsv4 replay --tolerance X --json`; a bad bound is an InputError."""
    for arg, value, logprobs in (([], True, None), (["0.2"], 0.2, None),
                                 (["0.2", "--tolerance-logprobs", "0.01"], 0.2, 0.01)):
        mine = dsv4.replay(train_trace, tolerance=value, tolerance_logprobs=logprobs)
        out = work / "replay-tolerance.json"
        assert cli("replay", train_trace, "--tolerance", *arg, "--json", out).returncode == 0
        assert without_seconds(mine) == without_seconds(json.loads(out.read_text()))
        assert mine["identical"] and mine["passed"]
    with pytest.raises(dsv4.InputError, match="--tolerance"):
        dsv4.replay(train_trace, tolerance=-1)
    with pytest.raises(dsv4.InputError, match="--tolerance"):
        dsv4.replay(train_trace, tolerance=float("nan"))
    with pytest.raises(dsv4.InputError, match="--tolerance-logprobs"):
        dsv4.replay(train_trace, tolerance=True, tolerance_logprobs=-1)
    with pytest.raises(ValueError, match="needs tolerance"):
        dsv4.replay(train_trace, tolerance_logprobs=0.01)


def test_diff_equals_the_cli(work, train_trace, rollout_trace):
    mine = dsv4.diff(train_trace, rollout_trace)
    out = work / "diff.json"
    cli("diff", train_trace, rollout_trace, "--json", out)
    assert mine == json.loads(out.read_text())
    assert mine["format"] == "dsv4-diff" and mine["seq_count"] == 1
    assert len(mine["tokens"]) == TOKENS - 1
    assert mine["trace_a"]["profile"] == "train" and mine["trace_b"]["profile"] == "rollout"


def test_run_errors_are_python_exceptions(tmp_path, train_trace):
    with pytest.raises(dsv4.TraceError, match="missing.h5"):
        dsv4.replay(tmp_path / "missing.h5")
    with pytest.raises(dsv4.InputError):
        dsv4.replay(train_trace, step=5)
    with pytest.raises(ValueError, match="unknown kind"):
        dsv4.replay(train_trace, force="experts")


def test_forward_of_a_checkpoint_equals_the_cli(work):
    model = work / "run-model"
    cli("model", "init", "--preset", "tiny", "--seed", 11, "--out", model)
    tokens = list(range(40, 70))
    mine = dsv4.forward(tokens, model=model, temperature=0.7)
    theirs = cli_json("forward", "--model", model, "--tokens", ",".join(map(str, tokens)), "--temperature", 0.7)
    assert mine == theirs


def test_counterfactual_replay_with_a_python_written_trace(work, train_trace, rollout_trace):
    """Replay the training step with the decisions of a trace written from Python (the rollout's,
    re-reported by an "engine"): the report equals the CLI's for the same command."""
    from test_writer import copy_as_external
    engine = work / "engine-rollout.h5"
    if not engine.exists():
        model = dsv4.open_trace(rollout_trace).model
        copy_as_external(rollout_trace, engine, model["config"], tensors=False, profile="rollout", engine="pytest",
                         weights_path=model["weights_path"], model_digest=model["digest"],
                         weight_names=model["tensor_names"], weight_digests=model["tensor_digests"])
    mine = dsv4.replay(train_trace, take_decisions_from=engine)
    out = work / "counterfactual.json"
    cli("replay", train_trace, "--take-decisions-from", engine, "--json", out, check=False)
    assert without_seconds(mine) == without_seconds(json.loads(out.read_text()))
    forced = mine["steps"][0]["counterfactual"]
    assert forced["decisions_equal"] and forced["source"].endswith("step 0, engine pytest")
