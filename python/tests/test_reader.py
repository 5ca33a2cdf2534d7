"""The Python reader against the C++ reader as the CLI prints it (`dsv4 trace info|dump --json`), on a
trace the C++ writer recorded: equal bit for bit, and row slices equal to the rows of the whole."""

import json

import numpy as np
import pytest

import dsv4
from conftest import TOKENS, cli, cli_json


def f32(v):
    """A JSON number as the float32 the CLI printed (null: a non-finite value)."""
    return np.float32(np.nan if v is None else float(v))


def same_f32(a, b):
    """Bitwise equality of float32 arrays (NaN patterns included)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def json_f32(values):
    return np.array([f32(v) for v in values], dtype=np.float32)


def same_as_json(a, values):
    """float32 values equal, bit for bit, to the numbers the CLI printed; JSON has no NaN or Inf and
    prints null for them, so there the value must not be finite."""
    a = np.asarray(a, np.float32).reshape(-1)
    values = list(values)
    if len(a) != len(values):
        return False
    printed = np.array([v is not None for v in values])
    return bool(np.all(~np.isfinite(a[~printed]))) and same_f32(a[printed], json_f32([v for v in values if v is not None]))


def test_metadata_equals_trace_info(train_trace):
    info = cli_json("trace", "info", train_trace, "--json")
    t = dsv4.open_trace(train_trace)
    assert t.format_version == info["format_version"]
    assert t.producer == info["producer"] and t.created == info["created"]
    assert t.model["digest"] == info["model"]["digest"]
    assert t.model["weights_path"] == info["model"]["weights_path"]
    assert t.model["config"]["num_hidden_layers"] == info["model"]["layers"]
    assert t.env == info["env"]
    assert len(t.steps) == len(info["steps"])
    for s, j in zip(t.steps, info["steps"]):
        assert (s.index, s.kind, s.profile, s.complete, s.capture, s.seq_lengths, s.seed) == (
            j["index"], j["kind"], j["profile"], j["complete"], j["capture"], j["seq_lengths"], j["seed"])
        assert not s.external and s.engine == ""
        assert s.profile_text.startswith("dsv4-profile = 1\nname = " + s.profile + "\n")
        assert len(j["profile_digest"]) == 16


def test_tokens_and_logprobs_equal_the_forward(train_trace):
    seq = dsv4.open_trace(train_trace).step(0).seq(0)
    fwd = cli_json("forward", "--preset", "tiny", "--seed", 7, "--random", TOKENS, "--profile", "train")
    assert seq.tokens.dtype == np.int32 and seq.tokens.tolist() == fwd["tokens"]
    assert seq.logprobs.dtype == np.float32 and same_as_json(seq.logprobs, fwd["logprobs"])
    assert seq.id == "" and seq.prompt_length is None


def test_decisions_equal_trace_dump(train_trace, tiny_config):
    seq = dsv4.open_trace(train_trace).step(0).seq(0)
    assert seq.layers == list(range(tiny_config["num_hidden_layers"]))
    indexed = 0
    for layer in seq.layers:
        ix = seq.indexer(layer)
        if ix is not None:
            indexed += 1
            rows = cli_json("trace", "dump", train_trace, "--what", "indexer", "--layer", layer, "--json")["rows"]
            assert ix["ids"].dtype == np.int32 and ix["ids"].shape[0] == len(rows) == TOKENS
            assert [sorted(r[r >= 0].tolist()) for r in ix["ids"]] == [r["ids"] for r in rows]
            assert same_as_json(ix["margin"], [r["margin"] for r in rows])
        rt = seq.routing(layer)
        rows = cli_json("trace", "dump", train_trace, "--what", "experts", "--layer", layer, "--json")["rows"]
        assert rt["ids"].tolist() == [r["experts"] for r in rows]
        assert same_as_json(rt["weights"], [w for r in rows for w in r["weights"]])
        assert same_as_json(rt["margin"], [r["margin"] for r in rows])
        mhc = cli_json("trace", "dump", train_trace, "--what", "mhc", "--layer", layer, "--json")
        for sub in ("attn", "ffn"):
            m = seq.mhc(layer, sub)
            for key in ("pre", "post", "comb"):
                assert m[key].shape[0] == len(mhc[sub]) == TOKENS
                assert same_as_json(m[key], [v for r in mhc[sub] for v in r[key]])
    assert indexed > 0, "the tiny preset has C4 layers"


def test_digests_equal_trace_dump(train_trace):
    d = dsv4.open_trace(train_trace).step(0).seq(0).digests()
    dump = cli_json("trace", "dump", train_trace, "--what", "digests", "--json")
    assert len(d) == len(dump["records"]) and d.values.dtype == np.uint64
    for i, rec in enumerate(dump["records"]):
        assert (d.names[i], int(d.layers[i])) == (rec["tensor"], rec["layer"])
        mine = d.values[d.first[i]:d.first[i] + d.rows[i]]
        assert ["{:016x}".format(int(v)) for v in mine] == rec["digests"]
        assert np.array_equal(d.of(rec["tensor"], rec["layer"]), mine)


@pytest.mark.parametrize("name,layer", [("attn.q", 0), ("moe.router_logits", 1), ("logprobs", -1), ("embed", -1)])
def test_tensors_equal_trace_dump(train_trace, name, layer):
    seq = dsv4.open_trace(train_trace).step(0).seq(0)
    assert (name, layer) in seq.tensors()
    t = seq.tensor(name, layer)
    dump = cli_json("trace", "dump", train_trace, "--what", "tensor", "--tensor", name, "--layer", layer, "--json")
    assert t.dtype == dump["dtype"] and list(t.shape) == dump["shape"]
    assert t.values.dtype == {"bf16": np.uint16, "f32": np.float32, "i32": np.int32}[t.dtype]
    assert np.asarray(t).dtype == t.values.dtype and np.array_equal(np.asarray(t), t.values)
    printed = [v for row in dump["rows"] for v in row]  # strings, "{:.9g}": round-trip exact for float32
    if t.dtype == "i32":
        assert t.values.ravel().tolist() == [int(v) for v in printed]
        return
    expected = np.array([np.float32(float(v)) for v in printed], dtype=np.float32).reshape(t.shape)
    assert same_f32(t.float32(), expected)
    if t.is_bf16:  # the stored bits are the printed values' upper halves
        assert np.array_equal(dsv4.float32_to_bf16(expected), t.values)


def test_row_slices_equal_rows_of_the_whole(train_trace):
    seq = dsv4.open_trace(train_trace).step(0).seq(0)
    layer = next(l for l in seq.layers if seq.indexer(l) is not None)
    whole_ix, whole_rt = seq.indexer(layer), seq.routing(layer)
    for rows in (slice(3, 9), slice(0, 1), slice(20, None), slice(TOKENS - 1, TOKENS + 50), slice(5, 5)):
        part = seq.indexer(layer, rows=rows)
        assert np.array_equal(part["ids"], whole_ix["ids"][rows]) and same_f32(part["margin"], whole_ix["margin"][rows])
        part = seq.routing(layer, rows=rows)
        for key in ("ids", "weights", "margin"):
            assert np.array_equal(part[key], whole_rt[key][rows])
    one = seq.routing(layer, rows=7)
    assert np.array_equal(one["ids"], whole_rt["ids"][7]) and one["margin"] == whole_rt["margin"][7]
    whole_t = seq.tensor("attn.q", 0)
    part = seq.tensor("attn.q", 0, rows=slice(2, 6))
    assert part.dtype == "bf16" and np.array_equal(part.values, whole_t.values[2:6])
    assert np.array_equal(seq.tensor("attn.q", 0, rows=4).values, whole_t.values[4])
    with pytest.raises(dsv4.TraceError, match=r"rows \[27, 28\) asked of 24 rows"):
        seq.routing(layer, rows=TOKENS + 3)
    with pytest.raises(ValueError, match="negative"):
        seq.indexer(layer, rows=slice(-3, None))


def test_errors_name_the_file(tmp_path, train_trace):
    with pytest.raises(dsv4.TraceError, match="nothing.h5"):
        dsv4.open_trace(tmp_path / "nothing.h5")
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"not hdf5 at all" * 100)
    with pytest.raises(dsv4.NotATrace, match="junk.h5"):
        dsv4.open_trace(junk)
    t = dsv4.open_trace(train_trace)
    with pytest.raises(IndexError, match="no step 3"):
        t.step(3)
    with pytest.raises(IndexError, match="no sequence 1"):
        t.step(0).seq(1)
    with pytest.raises(KeyError, match="not stored"):
        t.step(0).seq(0).tensor("no.such.tensor", 0)
    with pytest.raises(ValueError, match="attn' or 'ffn"):
        t.step(0).seq(0).mhc(0, "moe")
    seq = t.step(0).seq(0)
    with t:
        pass  # leaving the block closes the trace
    with pytest.raises(dsv4.TraceError, match="closed"):
        seq.tokens


def test_bf16_helpers():
    bits = np.array([0x3F80, 0xC000, 0x7F80, 0x0001], dtype=np.uint16)
    assert dsv4.bf16_to_float32(bits).tolist()[:3] == [1.0, -2.0, float("inf")]
    assert np.array_equal(dsv4.float32_to_bf16(dsv4.bf16_to_float32(bits)), bits)
    with pytest.raises(ValueError, match="not a bf16 value"):
        dsv4.float32_to_bf16(np.float32([1.0, 1.0 + 2.0 ** -20]))
    with pytest.raises(TypeError):
        dsv4.bf16_to_float32(np.zeros(3, np.float32))


def test_generation_record_equals_what_generate_printed(work):
    """A generation step's record against the responses `dsv4 generate` wrote (the C++ engine's own
    output): tokens, log-probs bit for bit, sampling settings and finish reasons; the schedule covers
    each request's positions once each, from 0."""
    prompts = work / "gen-prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": [1, 2, 3, 4, 5], "seed": 1}\n'
                       '{"id": "b", "prompt": [1, 2, 3, 9], "seed": 2, "temperature": 0.7, "top_k": 20}\n')
    out, trace = work / "gen.jsonl", work / "gen.h5"
    if not trace.exists():
        cli("generate", "--preset", "tiny", "--seed", 7, "--prompts", prompts, "--max-new-tokens", 6, "--quiet",
            "--out", out, "--record", trace)
    printed = [json.loads(line) for line in out.read_text().splitlines()]
    t = dsv4.open_trace(trace)
    g = t.step(0).generation()
    assert g is not None and t.step(0).kind == "generate"
    assert [r["id"] for r in g["requests"]] == [p["id"] for p in printed]
    for r, p in zip(g["requests"], printed):
        assert r["tokens"].tolist() == p["response"]
        assert same_as_json(r["logprobs"], p["logprobs"])
        assert r["finish_reason"] == p["finish_reason"]
        assert r["prompt_length"] == len(p["prompt"])
        assert (r["top_k"], r["sampling_seed"], r["request_key"]) == (
            p["sampling"]["top_k"], p["sampling"]["seed"], p["sampling"]["request_key"])
        assert np.float32(r["temperature"]) == np.float32(p["sampling"]["temperature"])
        assert r["counters"].shape == (len(p["response"]), 4) and r["counters"].dtype == np.uint32
    s = g["schedule"]
    for q, r in enumerate(g["requests"]):
        mine = s["request"] == q
        covered = sorted(p for p0, n in zip(s["pos0"][mine], s["length"][mine]) for p in range(p0, p0 + n))
        # Each position once, from 0, through at least the last one a token was sampled from.
        assert covered == list(range(len(covered)))
        assert len(covered) >= r["prompt_length"] + len(r["tokens"]) - 1
    # Other steps have no generation or training record; a CPU run recorded no kernels and says why.
    rec = dsv4.open_trace(_record_for(work)).step(0)
    assert rec.generation() is None and rec.training() is None
    k = rec.kernels()
    assert k["available"] is False and k["reason"] and len(k["names"]) == 0 and k["grid"].shape == (0, 3)


def _record_for(work):
    from conftest import _record
    return _record(work, "rollout", "decisions")


def test_training_record_equals_what_train_step_printed(work):
    """A training step's record against `dsv4 train-step --json` (the C++ step's own report): the
    metrics bit for bit as printed, the settings, the samples' loss inputs, every weight's digests."""
    samples = work / "train-samples.jsonl"
    samples.write_text(
        '{"id": "a", "prompt": [1, 2, 3, 4, 5], "response": [9, 8, 7, 6], "reward": 1, "group": "g"}\n'
        '{"id": "b", "prompt": [1, 2, 3], "response": [11, 12, 13, 14, 15], "reward": 0, "group": "g"}\n')
    model, trace = work / "train-m0", work / "train-step.h5"
    if not trace.exists():
        cli("model", "init", "--preset", "tiny", "--seed", 7, "--out", model)
        printed = json.loads(cli("train-step", "--model", model, "--data", samples, "--lr", "1e-3", "--out-model",
                                 work / "train-m1", "--record", trace, "--json").stdout)
        (work / "train-step.json").write_text(json.dumps(printed))
    printed = json.loads((work / "train-step.json").read_text())
    t = dsv4.open_trace(trace).step(0)
    rec = t.training()
    assert t.kind == "train-step" and rec is not None and t.generation() is None
    for key in ("loss", "pg_loss", "kl", "clip_fraction", "grad_norm"):
        assert rec["metrics"][key] == printed[key], key
    assert rec["settings"]["adamw"]["lr"] == 1e-3
    assert rec["optimizer_step_before"] == printed["step"] - 1
    assert [s["id"] for s in rec["samples"]] == ["a", "b"]
    assert [s["prompt_length"] for s in rec["samples"]] == [5, 3]
    assert [s["reward"] for s in rec["samples"]] == [1.0, 0.0]
    # Every float weight (the hash layers' integer tid2eid tables are not trained, so not recorded).
    names = [n for n in dsv4.open_trace(trace).model["tensor_names"] if not n.endswith(".tid2eid")]
    assert sorted(rec["params"]) == sorted(names)
    for name, p in rec["params"].items():
        assert p["weight"].dtype == np.uint64 and len(p["weight"]) == p["rows"], name
        assert p["grad"] is None or len(p["grad"]) == p["rows"], name
    assert rec["act_grads"] and all(len(a["digests"]) == a["rows"] for a in rec["act_grads"])
