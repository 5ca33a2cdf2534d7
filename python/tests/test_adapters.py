"""dsv4.import_sglang / import_miles and the reader of miles' .pt rollout dumps (dsv4.torch_pickle).

The .pt archives are written here two ways: by torch.save where PyTorch is installed, and, always, by
this file's own writer of torch.save's layout (a zip of data.pkl, whose tensors name their storages by
persistent id, and data/KEY), so that CI without PyTorch reads real archives too."""

import contextlib
import dataclasses
import enum
import io
import os
import pickle
import subprocess
import sys
import types
import zipfile

import numpy as np
import pytest

import dsv4
from dsv4 import torch_pickle

from conftest import CLI, cli


# ---- an independent writer of torch.save's archive layout -----------------------------------------------

class FakeTensor:
    """A tensor to write: the storage's values (1-D), and the view's offset, size and stride."""

    def __init__(self, storage, offset, size, stride, kind):
        self.storage, self.offset, self.size, self.stride, self.kind = storage, offset, size, stride, kind


@contextlib.contextmanager
def _fake_torch():
    """Modules named torch and torch._utils holding the names a torch.save pickle refers to, so that
    pickle writes GLOBAL 'torch._utils _rebuild_tensor_v2' and 'torch IntStorage' (only while writing;
    a real torch is put back)."""
    saved = {k: sys.modules.get(k) for k in ("torch", "torch._utils")}
    torch, utils = types.ModuleType("torch"), types.ModuleType("torch._utils")
    torch._utils = utils

    def _rebuild_tensor_v2(*a):
        raise AssertionError("never called while writing")

    _rebuild_tensor_v2.__module__, _rebuild_tensor_v2.__qualname__ = "torch._utils", "_rebuild_tensor_v2"
    utils._rebuild_tensor_v2 = _rebuild_tensor_v2
    for name in ("IntStorage", "LongStorage", "FloatStorage", "BFloat16Storage"):
        setattr(torch, name, type(name, (), {"__module__": "torch", "__qualname__": name}))
    sys.modules.update({"torch": torch, "torch._utils": utils})
    try:
        yield torch, utils
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def write_torch_archive(path, obj, byteorder="little"):
    """torch.save's zip layout for `obj`, whose FakeTensors become persistent storage references."""
    storages = []
    with _fake_torch() as (torch, utils):
        class P(pickle.Pickler):
            def persistent_id(self, x):
                if isinstance(x, _StorageRef):
                    return ("storage", getattr(torch, x.kind), x.key, "cpu", len(x.values))
                return None

            def reducer_override(self, x):
                if isinstance(x, FakeTensor):
                    key = str(len(storages))
                    storages.append(x.storage)
                    ref = _StorageRef(key, x.storage, x.kind)
                    return utils._rebuild_tensor_v2, (ref, x.offset, tuple(x.size), tuple(x.stride), False, {})
                return NotImplemented

        buf = io.BytesIO()
        P(buf, protocol=2).dump(obj)
    stem = "archive"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(stem + "/data.pkl", buf.getvalue())
        z.writestr(stem + "/byteorder", byteorder)
        for key, values in enumerate(storages):
            v = np.asarray(values)
            z.writestr("{}/data/{}".format(stem, key), (v.astype(v.dtype.newbyteorder(">")) if byteorder == "big" else v).tobytes())
        z.writestr(stem + "/version", "3\n")


class _StorageRef:
    def __init__(self, key, values, kind):
        self.key, self.values, self.kind = key, values, kind


@dataclasses.dataclass(frozen=True)
class AdapterRef:  # as miles' Sample.adapter: a class the reader does not construct
    name: str
    slot: int


class Status(enum.Enum):
    COMPLETED = "completed"


def have_torch():
    """Without importing it here (see test_reads_what_torch_save_wrote)."""
    import importlib.util
    return importlib.util.find_spec("torch") is not None


# ---- dsv4.torch_pickle ---------------------------------------------------------------------------------

@pytest.mark.parametrize("byteorder", ["little", "big"])
def test_reads_torch_save_archives(tmp_path, byteorder):
    base = np.arange(24, dtype=np.int32)
    bf16 = np.array([0x3F80, 0xC000, 0x7F80], dtype=np.uint16)  # 1.0, -2.0, inf as bfloat16 bits
    obj = {
        "rollout_id": 4,
        "view": FakeTensor(base, 2, (2, 3), (1, 4), "IntStorage"),  # a transposed, offset view
        "longs": FakeTensor(np.array([5, -6, 7], dtype=np.int64), 0, (3,), (1,), "LongStorage"),
        "bf16": FakeTensor(bf16, 0, (3,), (1,), "BFloat16Storage"),
        "empty": FakeTensor(np.zeros(0, dtype=np.float32), 0, (0, 4), (4, 1), "FloatStorage"),
        "inline": np.arange(6, dtype=np.int32).reshape(2, 3),
        "scalar": np.float32(1.5),
        "adapter": AdapterRef("lora-a", 3),
        "status": Status.COMPLETED,
        "nested": [{"x": (1, 2.5, None, True, "s", b"b")}, {1, 2}],
    }
    write_torch_archive(tmp_path / "a.pt", obj, byteorder)
    got = torch_pickle.load(tmp_path / "a.pt")
    want_view = np.lib.stride_tricks.as_strided(base[2:], shape=(2, 3), strides=(4, 16))
    assert got["view"].dtype == np.int32 and got["view"].flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(got["view"], want_view)
    np.testing.assert_array_equal(got["view"], [[2, 6, 10], [3, 7, 11]])
    assert got["longs"].dtype == np.int64 and got["longs"].tolist() == [5, -6, 7]
    assert got["bf16"].dtype == np.uint16 and got["bf16"].tolist() == bf16.tolist()
    np.testing.assert_array_equal(dsv4.bf16_to_float32(got["bf16"]), [1.0, -2.0, np.inf])
    assert got["empty"].shape == (0, 4)
    np.testing.assert_array_equal(got["inline"], obj["inline"])
    assert got["scalar"] == np.float32(1.5) and got["rollout_id"] == 4
    assert isinstance(got["adapter"], torch_pickle.Opaque)
    assert got["adapter"]._name.endswith("AdapterRef") and got["adapter"].fields == {"name": "lora-a", "slot": 3}
    assert isinstance(got["status"], torch_pickle.Opaque) and got["status"]._name.endswith("Status.COMPLETED")
    assert got["nested"] == obj["nested"]


@pytest.mark.skipif(not have_torch(), reason="PyTorch (python3-torch) is not installed")
def test_reads_what_torch_save_wrote(tmp_path):
    # torch.save in another process: importing torch here would change this process's OpenMP threads.
    script = """
import dataclasses, sys, numpy as np, torch
sys.path.insert(0, {tests!r})
from test_adapters import AdapterRef
t = torch.arange(30, dtype=torch.int32).reshape(5, 6)
obj = {{"samples": [{{"tokens": [1, 2, 3], "ids": t[1:4, ::2], "long": torch.tensor([1, 2], dtype=torch.int64),
                     "bf16": torch.tensor([1.0, -2.5], dtype=torch.bfloat16), "np": np.ones((2, 2), np.int32),
                     "shared": t, "adapter": AdapterRef("a", 1)}}]}}
torch.save(obj, {out!r})
""".format(tests=os.path.dirname(__file__), out=str(tmp_path / "t.pt"))
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    got = torch_pickle.load(tmp_path / "t.pt")["samples"][0]
    t = np.arange(30, dtype=np.int32).reshape(5, 6)
    np.testing.assert_array_equal(got["ids"], t[1:4, ::2])
    np.testing.assert_array_equal(got["shared"], t)
    assert got["long"].dtype == np.int64 and got["long"].tolist() == [1, 2]
    np.testing.assert_array_equal(dsv4.bf16_to_float32(got["bf16"]), [1.0, -2.5])
    assert got["tokens"] == [1, 2, 3] and got["np"].dtype == np.int32
    assert got["adapter"]._name == "test_adapters.AdapterRef" and got["adapter"].fields == {"name": "a", "slot": 1}


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, ("touch " + str(self.marker),))


def _archive_of_pickle(path, data):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", data)


def test_runs_none_of_the_files_code(tmp_path):
    marker = tmp_path / "ran"
    _archive_of_pickle(tmp_path / "evil.pt", pickle.dumps({"samples": [_RunsCode(marker)]}, protocol=2))
    got = torch_pickle.load(tmp_path / "evil.pt")
    assert not marker.exists(), "the file's code ran"
    assert isinstance(got["samples"][0], torch_pickle.Opaque) and got["samples"][0]._name in ("posix.system", "os.system")
    # getattr, as enums are pickled, only on stand-ins: getattr(OrderedDict, 'fromkeys') is refused.
    data = b"\x80\x02cbuiltins\ngetattr\nccollections\nOrderedDict\nX\x08\x00\x00\x00fromkeys\x86R."
    _archive_of_pickle(tmp_path / "getattr.pt", data)
    with pytest.raises(dsv4.InputError, match=r"getattr.pt: archive/data.pkl: cannot read the pickle: getattr on .* is not allowed"):
        torch_pickle.load(tmp_path / "getattr.pt")


def test_files_that_are_not_archives_are_named(tmp_path):
    (tmp_path / "legacy.pt").write_bytes(pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2))
    with pytest.raises(dsv4.InputError, match=r"legacy.pt: a legacy torch.save file .*save it again"):
        torch_pickle.load(tmp_path / "legacy.pt")
    (tmp_path / "text.pt").write_text("hello")
    with pytest.raises(dsv4.InputError, match=r"text.pt: not a torch.save file \(not a zip archive\)"):
        torch_pickle.load(tmp_path / "text.pt")
    with zipfile.ZipFile(tmp_path / "nopkl.pt", "w") as z:
        z.writestr("a/b", "x")
    with pytest.raises(dsv4.InputError, match=r"nopkl.pt: not a torch.save archive \(no single data.pkl"):
        torch_pickle.load(tmp_path / "nopkl.pt")
    _archive_of_pickle(tmp_path / "cut.pt", pickle.dumps({"a": list(range(100))}, protocol=2)[:40])
    with pytest.raises(dsv4.InputError, match=r"cut.pt: archive/data.pkl: cannot read the pickle"):
        torch_pickle.load(tmp_path / "cut.pt")
    write_torch_archive(tmp_path / "short.pt", {"t": FakeTensor(np.arange(4, dtype=np.int32), 2, (3,), (1,), "IntStorage")})
    with pytest.raises(dsv4.InputError, match=r"reaches element 4 of a storage of 4"):
        torch_pickle.load(tmp_path / "short.pt")


# ---- imports ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def batch_trace(work):
    """Three sequences of 24, 13 and 30 tokens recorded in one step (tiny, decisions)."""
    out = work / "batch3.h5"
    if not out.exists():
        rng = np.random.default_rng(5)
        (work / "batch3.jsonl").write_text("".join("{}\n".format(rng.integers(0, 512, n).tolist()) for n in (24, 13, 30)))
        cli("record", "--preset", "tiny", "--batch", work / "batch3.jsonl", "--profile", "rollout", "--capture",
            "decisions", "--out", out)
    return out


@pytest.fixture(scope="module")
def miles_export(work, batch_trace):
    """`dsv4 export miles` of the batch trace: one .npz per sequence, read back as numpy arrays."""
    out = work / "miles-export"
    if not out.exists():
        cli("export", "miles", batch_trace, "--out", out)
    samples = []
    for f in sorted(out.glob("*.npz")):
        with np.load(f) as z:
            samples.append({k: z[k] for k in z.files})
    return out, samples


def miles_dump(samples, as_tensors=False):
    """miles' torch.save(dict(rollout_id=..., samples=[Sample.to_dict(), ...])) of the exported samples,
    with the other fields a Sample has."""
    out = []
    for i, s in enumerate(samples):
        tokens = s["tokens"].tolist()
        d = {"group_index": 0, "index": 100 + i, "prompt": "p", "tokens": tokens, "response": "r",
             "response_length": int(s["response_length"]) if "response_length" in s else 2, "reward": 1.0,
             "loss_mask": None, "rollout_log_probs": [-0.5, -0.25], "status": "completed",
             "adapter": AdapterRef("base", 0), "metadata": {"k": Status.COMPLETED},
             "spec_info": {"spec_accept_token_num": 0}}
        for name in ("rollout_routed_experts", "rollout_indexer_topk"):
            a = s[name]
            d[name] = FakeTensor(a.ravel(), 0, a.shape, tuple(x // 4 for x in a.strides), "IntStorage") if as_tensors else a
        out.append(d)
    return {"rollout_id": 0, "samples": out}


def decisions(path):
    """Every sequence's tokens, and each layer's routing and indexer ids (None where a layer has none)."""
    got = []
    for seq in dsv4.open_trace(path).step(0).sequences:
        rows = []
        for layer in seq.layers:
            r, x = seq.routing(layer), seq.indexer(layer)
            rows.append((layer, None if r is None else r["ids"].tolist(), None if x is None else x["ids"].tolist()))
        got.append((seq.tokens.tolist(), rows))
    return got


@pytest.mark.parametrize("as_tensors", [False, True])
def test_import_miles_pt_is_the_import_of_the_npz_files(tmp_path, miles_export, as_tensors):
    out, samples = miles_export
    write_torch_archive(tmp_path / "rollout_0.pt", miles_dump(samples, as_tensors))
    r = dsv4.import_miles([tmp_path / "rollout_0.pt"], tmp_path / "pt.h5", preset="tiny")
    assert r["requests"] == len(samples) and r["trace"] == str(tmp_path / "pt.h5")
    assert any("rollout_log_probs cover the response only" in n for n in r["notes"])
    npz = dsv4.import_miles([out], tmp_path / "npz.h5", preset="tiny")
    assert npz["requests"] == len(samples)
    assert decisions(tmp_path / "pt.h5") == decisions(tmp_path / "npz.h5")
    t = dsv4.open_trace(tmp_path / "pt.h5")
    assert t.step(0).engine == "miles"
    assert [t.step(0).seq(i).id for i in range(len(samples))] == [str(100 + i) for i in range(len(samples))]


def test_command_lines_for_pt_dumps(tmp_path, miles_export):
    _, samples = miles_export
    write_torch_archive(tmp_path / "rollout_0.pt", miles_dump(samples))
    env = {**os.environ}
    p = subprocess.run([sys.executable, "-m", "dsv4", "import", "miles", str(tmp_path / "rollout_0.pt"), "--preset",
                        "tiny", "--out", str(tmp_path / "m.h5")], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    assert "import miles: {} requests".format(len(samples)) in p.stderr
    cli("trace", "validate", tmp_path / "m.h5")
    # The dsv4 command points at the Python one.
    p = cli("import", "miles", tmp_path / "rollout_0.pt", "--preset", "tiny", "--out", tmp_path / "c.h5", check=False)
    assert p.returncode == 2
    assert "a PyTorch pickle" in p.stderr and "python3 -m dsv4 import miles" in p.stderr
    # Bad input: exit 2 and the message, no trace left behind.
    p = subprocess.run([sys.executable, "-m", "dsv4", "import", "miles", str(tmp_path / "rollout_0.pt"), "--preset",
                        "tiny-b", "--out", str(tmp_path / "b.h5")], capture_output=True, text=True, env=env)
    assert p.returncode == 2 and p.stderr.startswith("dsv4: error: ") and not (tmp_path / "b.h5").exists()
    p = subprocess.run([sys.executable, "-m", "dsv4", "import", "miles", "x.pt", "--out", "y.h5"],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 2 and "--config" in p.stderr  # argparse: one of --config/--model/--preset required


def test_pt_pitfalls_are_refused_by_name(tmp_path, miles_export):
    _, samples = miles_export

    def error_of(dump, **kw):
        write_torch_archive(tmp_path / "bad.pt", dump)
        with pytest.raises(dsv4.InputError) as e:
            dsv4.import_miles([tmp_path / "bad.pt"], tmp_path / "bad.h5", preset="tiny", **kw)
        assert not (tmp_path / "bad.h5").exists()
        return str(e.value)

    d = miles_dump(samples)
    d["samples"][1]["rollout_routed_experts"] = np.zeros_like(samples[1]["rollout_routed_experts"])
    assert "bad.pt: request '101' (#1): routed_experts: every layer, every row is expert 0" in error_of(d)
    d = miles_dump(samples)
    d["samples"][0]["rollout_routed_experts"] = samples[0]["rollout_routed_experts"].astype(np.int64)
    assert "bad.pt: request '100' (#0): rollout_routed_experts: dtype '<i8', expected int32" in error_of(d)
    d = miles_dump(samples)
    del d["samples"][0]["tokens"]
    assert "bad.pt: request '100' (#0): no tokens array" in error_of(d)
    d = miles_dump(samples)
    d["samples"][0]["rollout_routed_experts"] = None
    d["samples"][0]["rollout_indexer_topk"] = None
    assert "request '100' (#0): neither rollout_routed_experts nor rollout_indexer_topk" in error_of(d)
    d = miles_dump(samples)
    d["samples"][0]["rollout_indexer_topk"] = [[1, 2], [3]]
    assert "request '100' (#0): rollout_indexer_topk: not an array of numbers" in error_of(d)
    assert "not a miles rollout dump (expected a dict with 'samples', got int)" in error_of(7)
    write_torch_archive(tmp_path / "ok.pt", miles_dump(samples))
    with pytest.raises(dsv4.InputError, match="not both in one import"):
        dsv4.import_miles([tmp_path / "ok.pt", miles_export[0]], tmp_path / "mixed.h5", preset="tiny")


def test_import_sglang_is_the_command_line_import(tmp_path, batch_trace):
    cli("export", "sglang", batch_trace, "--out", tmp_path / "r.jsonl")
    r = dsv4.import_sglang(tmp_path / "r.jsonl", tmp_path / "py.h5", preset="tiny")
    cli("import", "sglang", tmp_path / "r.jsonl", "--preset", "tiny", "--out", tmp_path / "cli.h5")
    assert r["requests"] == 3 and r["tokens"] == 24 + 13 + 30
    # int32 buffers: (T − 1) rows × 6 layers × 2 ids, and × 2 C4 layers × index_topk 8.
    assert r["int32_bytes"] == (23 + 12 + 29) * (6 * 2 + 2 * 8) * 4
    assert r["trace_bytes"] == os.path.getsize(tmp_path / "py.h5")
    assert decisions(tmp_path / "py.h5") == decisions(tmp_path / "cli.h5")
    with pytest.raises(dsv4.InputError, match="give exactly one of config=, model= or preset="):
        dsv4.import_sglang(tmp_path / "r.jsonl", tmp_path / "x.h5")
