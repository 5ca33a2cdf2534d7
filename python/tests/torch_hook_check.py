"""Runs python/examples/torch_hook.py on a stand-in model whose modules are named and answer like the
reference inference code's (layers.N.mlp.gate -> (weights, ids), layers.N.attn.indexer -> ids, -1 for
empty slots), and checks that the trace holds what they returned. Its own process (test_examples.py):
importing torch changes the process's OpenMP threads.

Usage: torch_hook_check.py EXAMPLES_DIR CONFIG.json OUT.h5"""

import importlib.util
import json
import sys

import numpy as np
import torch

import dsv4


def main(examples, config_path, out):
    spec = importlib.util.spec_from_file_location("torch_hook", examples + "/torch_hook.py")
    torch_hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(torch_hook)
    config = json.loads(open(config_path).read())
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
    torch_hook.record(model, config_path, sequences, out)
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


if __name__ == "__main__":
    main(*sys.argv[1:4])
