"""The examples: write_trace.py runs and writes a valid trace; torch_hook.py compiles, and where PyTorch
is installed (python3-torch; not a dependency) records a stand-in model whose modules answer like the
reference inference code's."""

import json
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
    inference code's (mlp.gate -> (weights, ids), attn.indexer -> ids with -1 for empty slots): the
    trace holds what the hooks saw, as sets, and the log-probs of the forward."""
    torch = pytest.importorskip("torch")
    import importlib.util
    spec = importlib.util.spec_from_file_location("torch_hook", EXAMPLES / "torch_hook.py")
    torch_hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(torch_hook)
    model_dir = work / "torch-hook-model"
    cli("model", "init", "--preset", "tiny", "--seed", 5, "--out", model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    L, E, k, K = (config[x] for x in ("num_hidden_layers", "n_routed_experts", "num_experts_per_tok", "index_topk"))
    V = config["vocab_size"]

    class Gate(torch.nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def forward(self, x):  # x: [T, d]; experts in descending order, weights summing to 1
            t = torch.arange(x.shape[0])[:, None]
            ids = (t * 3 + self.layer + torch.arange(k)[None, :] * 2) % E
            return torch.full((x.shape[0], k), 1.0 / k, dtype=torch.bfloat16), ids.flip(1)

    class Indexer(torch.nn.Module):
        def forward(self, x):  # visible groups, newest first, at most the runtime width; -1 after
            T = x.shape[0]
            out = torch.full((T, K), -1, dtype=torch.int32)
            for t in range(T):
                n = min((t + 1) // 4, K, T // 4)
                out[t, :n] = torch.arange(n - 1, -1, -1, dtype=torch.int32) + ((t + 1) // 4 - n)
            return out

    class Layer(torch.nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.mlp = torch.nn.Module()
            self.mlp.gate = Gate(layer)
            self.attn = torch.nn.Module()
            if config["compress_ratios"][layer] == 4:
                self.attn.indexer = Indexer()

        def forward(self, x):
            if hasattr(self.attn, "indexer"):
                self.attn.indexer(x)
            self.mlp.gate(x)
            return x

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed = torch.nn.Embedding(V, 8)
            self.layers = torch.nn.ModuleList([Layer(l) for l in range(L)])
            self.head = torch.nn.Linear(8, V)

        def forward(self, tokens):
            x = self.embed(tokens[0])
            for layer in self.layers:
                x = layer(x)
            return self.head(x)[None]

    model = Model()
    sequences = [[(7 * t + 1) % V for t in range(20)], [(5 * t + 2) % V for t in range(13)]]
    out = tmp_path / "torch.h5"
    torch_hook.record(model, str(model_dir / "config.json"), sequences, str(out))
    assert cli("trace", "validate", out, check=False).returncode == 0
    step = dsv4.open_trace(out).step(0)
    assert (step.engine, step.kind, len(step)) == ("pytorch", "train", 2)
    for s, tokens in enumerate(sequences):
        seq = step.seq(s)
        T = len(tokens)
        assert list(seq.tokens) == tokens
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([tokens]))[0, :-1].float(), -1)
        want = logp.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy()
        assert np.array_equal(seq.logprobs, want)
        for layer in range(L):
            r = seq.routing(layer)
            t = np.arange(T)[:, None]
            ids = np.sort((t * 3 + layer + np.arange(k)[None, :] * 2) % E, axis=1)
            assert np.array_equal(r["ids"], ids), layer
            assert np.all(r["weights"] == np.float32(1.0 / k))
            if config["compress_ratios"][layer] != 4:
                assert seq.indexer(layer) is None
                continue
            x = seq.indexer(layer)["ids"]
            width = min(K, T // 4)
            assert x.shape == (T, width)
            for row in range(T):
                n = min((row + 1) // 4, width)
                want_row = list(range((row + 1) // 4 - n, (row + 1) // 4)) + [-1] * (width - n)
                assert list(x[row]) == want_row, (layer, row)
