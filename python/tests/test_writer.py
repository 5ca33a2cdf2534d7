"""TraceWriter: traces written from Python read back by the C++ reader (the CLI, and the bindings over
TraceReader) bit for bit, the writer's checks raising with their message, and crash safety."""

import json
from pathlib import Path

import numpy as np
import pytest

import dsv4
from conftest import TOKENS, cli, cli_json


def c4_layers(config):
    return [l for l in range(config["num_hidden_layers"]) if config["compress_ratios"][l] == 4]


def copy_as_external(src, dst, config, tensors=True, **writer_args):
    """Write step 0 of a C++-written trace again, as an engine would report it: tokens, log-probs, the
    indexer and routing decisions (routing rows reversed, indexer rows padded with -1 in front: the
    writer must store them as the sets they are), and (with `tensors`) a tensor of each dtype."""
    seq = dsv4.open_trace(src).step(0).seq(0)
    with dsv4.TraceWriter(dst, config, **writer_args) as w:
        w.begin_step()
        w.add_sequence(seq.tokens.tolist(), logprobs=seq.logprobs, id="req-0", prompt_length=8)
        for layer in seq.layers:
            ix = seq.indexer(layer)
            if ix is not None:
                pad = np.full((ix["ids"].shape[0], 1), -1, np.int64)
                w.record_indexer(layer, np.hstack([pad, ix["ids"][:, ::-1]]))
            rt = seq.routing(layer)
            w.record_routing(layer, rt["ids"][:, ::-1], rt["weights"][:, ::-1])
        if tensors:
            w.record_tensor("attn.q", 0, seq.tensor("attn.q", 0).values)  # uint16: bf16 bits
            w.record_tensor("attn.kv", 1, seq.tensor("attn.kv", 1).float32(), dtype="bf16")  # bf16-exact floats
            w.record_tensor("logits", -1, seq.tensor("logits", -1).values)  # float32
            w.record_tensor("positions", -1, np.arange(TOKENS, dtype=np.int32).reshape(TOKENS, 1))
        w.end_step()
    return seq


@pytest.fixture(scope="session")
def model_dir(work):
    d = work / "tiny-model"
    if not d.exists():
        cli("model", "init", "--preset", "tiny", "--seed", 7, "--out", d)
    return d


@pytest.fixture(scope="session")
def external_copy(work, train_trace, tiny_config):
    dst = work / "external-copy.h5"
    if not dst.exists():
        model = dsv4.open_trace(train_trace).model
        copy_as_external(train_trace, dst, tiny_config, profile="train", kind="train", engine="pytest",
                         source="train.h5", weights_path=model["weights_path"], model_digest=model["digest"],
                         weight_names=model["tensor_names"], weight_digests=model["tensor_digests"])
    return dst


def test_python_written_trace_validates(external_copy):
    assert external_copy.exists() and not Path(str(external_copy) + ".incomplete").exists()
    v = cli("trace", "validate", external_copy, "--json", check=False)
    assert v.returncode == 0, v.stdout + v.stderr
    info = cli_json("trace", "info", external_copy, "--json")
    assert [(s["kind"], s["profile"], s["complete"], s["seq_lengths"]) for s in info["steps"]] == [
        ("train", "train", True, [TOKENS])]


def test_round_trip_is_bitwise(train_trace, external_copy):
    src = dsv4.open_trace(train_trace).step(0).seq(0)
    t = dsv4.open_trace(external_copy)
    step = t.step(0)
    assert (step.external, step.engine, step.source, step.kind, step.profile) == (True, "pytest", "train.h5", "train", "train")
    seq = step.seq(0)
    assert (seq.id, seq.prompt_length) == ("req-0", 8)
    assert np.array_equal(seq.tokens, src.tokens)
    assert np.array_equal(seq.logprobs.view(np.uint32), src.logprobs.view(np.uint32))
    for layer in src.layers:
        a, b = src.indexer(layer), seq.indexer(layer)
        assert (a is None) == (b is None)
        if a is not None:  # stored as sets: ascending, -1 dropped
            assert [sorted(r[r >= 0].tolist()) for r in a["ids"]] == [r[r >= 0].tolist() for r in b["ids"]]
            assert b["margin"] is None
        a, b = src.routing(layer), seq.routing(layer)
        assert np.array_equal(a["ids"], b["ids"])
        assert np.array_equal(a["weights"].view(np.uint32), b["weights"].view(np.uint32))
        assert b["margin"] is None
    assert np.array_equal(seq.tensor("attn.q", 0).values, src.tensor("attn.q", 0).values)
    assert np.array_equal(seq.tensor("attn.kv", 1).values, src.tensor("attn.kv", 1).values)
    assert np.array_equal(seq.tensor("logits", -1).values.view(np.uint32), src.tensor("logits", -1).values.view(np.uint32))
    assert seq.tensor("positions", -1).values.ravel().tolist() == list(range(TOKENS))


def test_cpp_reader_sees_the_same_decisions(external_copy, tiny_config):
    """The CLI's reader on the Python-written trace: the same ids and weights, bit for bit (weights are
    printed with 9 significant digits, which round-trip float32), and no margins (none were given)."""
    seq = dsv4.open_trace(external_copy).step(0).seq(0)
    for layer in range(tiny_config["num_hidden_layers"]):
        rows = cli_json("trace", "dump", external_copy, "--what", "experts", "--layer", layer, "--json")["rows"]
        rt = seq.routing(layer)
        assert rt["ids"].tolist() == [r["experts"] for r in rows]
        printed = np.array([r["weights"] for r in rows], dtype=np.float32)
        assert np.array_equal(printed.view(np.uint32), rt["weights"].view(np.uint32))
        assert all("margin" not in r for r in rows)
    for layer in c4_layers(tiny_config):
        rows = cli_json("trace", "dump", external_copy, "--what", "indexer", "--layer", layer, "--json")["rows"]
        assert [r[r >= 0].tolist() for r in seq.indexer(layer)["ids"]] == [r["ids"] for r in rows]


def test_cpp_reader_sees_the_same_tensor(external_copy, train_trace):
    mine = cli_json("trace", "dump", external_copy, "--what", "tensor", "--tensor", "attn.q", "--layer", 0, "--json")
    theirs = cli_json("trace", "dump", train_trace, "--what", "tensor", "--tensor", "attn.q", "--layer", 0, "--json")
    assert mine == theirs


def test_diff_of_the_copy_finds_the_same_decisions(work, train_trace, external_copy):
    report = dsv4.diff(train_trace, external_copy)
    out = work / "copy.diff.json"
    cli("diff", train_trace, external_copy, "--json", out)
    assert report == json.loads(out.read_text())
    assert not report["model_mismatch"] and report["layers"]
    for layer in report["layers"]:
        assert layer["routing"]["exact"] == 1.0 and layer["routing"]["rows_differing"] == 0
        if layer["indexer"] is not None:
            assert layer["indexer"]["overlap_mean"] == 1.0 and layer["indexer"]["rows_differing"] == 0
    assert report["logprobs"]["abs_max"] == 0.0


def test_model_config_forms_agree(work, model_dir, tiny_config):
    text = (model_dir / "config.json").read_text()
    configs = []
    for i, form in enumerate([model_dir / "config.json", str(model_dir), text, json.loads(text)]):
        path = work / "forms-{}.h5".format(i)
        with dsv4.TraceWriter(path, form) as w:
            w.begin_step()
            w.add_sequence([1, 2, 3])
            w.end_step()
        configs.append(dsv4.open_trace(path).model["config"])
    assert all(c == configs[0] for c in configs)
    assert configs[0]["num_hidden_layers"] == tiny_config["num_hidden_layers"]


def fresh_writer(work, config, name):
    path = work / name
    w = dsv4.TraceWriter(path, config)
    w.begin_step()
    return w, path


def routing_rows(config, rows=TOKENS):
    k, e = config["num_experts_per_tok"], config["n_routed_experts"]
    return np.array([[(t + i) % e for i in range(k)] for t in range(rows)], np.int32)


def indexer_rows(config, rows=TOKENS):
    """Valid indexer rows: position t sees the groups below (t + 1) // 4, at most the runtime's width."""
    width = min(config["index_topk"], rows // 4)
    ids = np.full((rows, width), -1, np.int32)
    for t in range(rows):
        visible = list(range((t + 1) // 4))[-width:] if width else []
        ids[t, :len(visible)] = visible
    return ids


def test_writer_checks_raise_with_the_message(work, tiny_config):
    c4 = c4_layers(tiny_config)[0]
    tokens = list(range(1, TOKENS + 1))
    w, path = fresh_writer(work, tiny_config, "checks.h5")

    def rejected(record, *match):
        w.add_sequence(tokens, id="bad")
        record()
        with pytest.raises(dsv4.InputError) as e:
            w.add_sequence(tokens, id="next")  # the bad sequence is checked when it is handed over
        for m in match:
            assert m in str(e.value), str(e.value)

    good = indexer_rows(tiny_config)
    rejected(lambda: w.record_indexer(c4, good[:, :-1]), "width", "layer {}".format(c4))
    bad = routing_rows(tiny_config)
    bad[5, 0] = tiny_config["n_routed_experts"]
    rejected(lambda: w.record_routing(0, bad), "layer 0", "5")
    future = good.copy()
    future[9, 0] = 3  # position 9 sees groups 0 and 1 only
    rejected(lambda: w.record_indexer(c4, future), "layer {}".format(c4), "9")
    rejected(lambda: w.record_routing(0, routing_rows(tiny_config), np.ones((TOKENS, 1), np.float32)), "layer 0")
    rejected(lambda: w.record_tensor("attn.q", 0, np.full((TOKENS, 4), 1 + 2 ** -20, np.float32), dtype="bf16"),
             "attn.q", "not a bf16 value")
    with pytest.raises(dsv4.InputError, match="oov.*outside the vocabulary"):
        w.add_sequence([1, tiny_config["vocab_size"]], id="oov")
        w.add_sequence(tokens, id="next")
    with pytest.raises(dsv4.InputError, match="short.*log-probs"):
        w.add_sequence([1, 2, 3], logprobs=[-1.0], id="short")
        w.add_sequence(tokens, id="next")
    # Checks on the Python side, at the call.
    w.add_sequence(tokens, id="ok")
    with pytest.raises(dsv4.InputError, match="expected integers"):
        w.record_routing(0, bad.astype(np.float32))
    with pytest.raises(dsv4.InputError, match="does not fit in int32"):
        w.record_routing(0, bad.astype(np.int64) + 2 ** 32)
    with pytest.raises(dsv4.InputError, match="out of range"):
        w.record_routing(tiny_config["num_hidden_layers"], bad)
    with pytest.raises(dsv4.InputError, match="2-D"):
        w.record_indexer(c4, good.ravel())
    # After the errors the writer still writes a good sequence and a valid trace.
    w.record_indexer(c4, good)
    w.record_routing(0, routing_rows(tiny_config), np.full((TOKENS, tiny_config["num_experts_per_tok"]), 0.5, np.float32))
    w.end_step()
    w.close()
    assert cli("trace", "validate", path, check=False).returncode == 0
    # Written: "ok" only (a call that raised for the sequence before it did not start its own).
    step = dsv4.open_trace(path).step(0)
    assert [q.id for q in step.sequences] == ["ok"]
    seq = step.seq(0)
    assert np.array_equal(seq.indexer(c4)["ids"][:, :good.shape[1]], good) and seq.routing(c4) is None


def test_state_errors(work, tiny_config):
    path = work / "state.h5"
    w = dsv4.TraceWriter(path, tiny_config)
    with pytest.raises(dsv4.InputError, match="begin_step"):
        w.add_sequence([1, 2])
    w.begin_step()
    with pytest.raises(dsv4.InputError, match="add_sequence first"):
        w.record_routing(0, routing_rows(tiny_config, 2))
    w.add_sequence([1, 2])
    w.end_step()
    w.close()
    with pytest.raises(dsv4.InputError, match="closed"):
        w.begin_step()
    with pytest.raises(dsv4.InputError):  # refuses to overwrite
        dsv4.TraceWriter(path, tiny_config)


def test_exception_in_with_block_leaves_incomplete(work, tiny_config):
    path = work / "crashed.h5"
    with pytest.raises(RuntimeError, match="engine died"):
        with dsv4.TraceWriter(path, tiny_config) as w:
            w.begin_step()
            w.add_sequence([5, 6, 7])
            w.end_step()
            w.begin_step()
            w.add_sequence([5, 6, 7])
            raise RuntimeError("engine died")
    assert not path.exists()
    left = Path(str(path) + ".incomplete")
    assert left.exists()
    steps = dsv4.open_trace(left).steps  # what a crash leaves: the ended step, the open one at status 0
    assert [s.complete for s in steps] == [True, False] and "status 0" in steps[1].why_not_complete
    assert cli("trace", "validate", left, check=False).returncode == 1


def test_routing_without_weights(work, tiny_config):
    path = work / "no-weights.h5"
    with dsv4.TraceWriter(path, tiny_config, engine="sglang") as w:
        w.begin_step()
        w.add_sequence(list(range(TOKENS)), id="r")
        w.record_routing(0, routing_rows(tiny_config)[:-1])  # T - 1 rows: the engines' layout
        w.end_step()
    rt = dsv4.open_trace(path).step(0).seq(0).routing(0)
    assert rt["weights"] is None and rt["margin"] is None and rt["ids"].shape[0] == TOKENS - 1
    rows = cli_json("trace", "dump", path, "--what", "experts", "--layer", 0, "--json")["rows"]
    assert [r["experts"] for r in rows] == rt["ids"].tolist() and all("weights" not in r for r in rows)


def test_with_block_ending_inside_a_step_raises_and_leaves_incomplete(work, tiny_config):
    path = work / "unended.h5"
    with pytest.raises(dsv4.Error, match="still open"):
        with dsv4.TraceWriter(path, tiny_config) as w:
            w.begin_step()
            w.add_sequence([5, 6, 7])
    assert not path.exists() and Path(str(path) + ".incomplete").exists()
