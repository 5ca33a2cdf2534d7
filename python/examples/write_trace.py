"""Write a trace the way an engine would, with numpy only: a made-up engine that routes each token to
the experts (t + i) mod E and lets position t attend to its most recent compressed groups.

    PYTHONPATH=build/python /usr/bin/python3 python/examples/write_trace.py out.h5 MODEL_DIR/config.json
    build/cli/dsv4 trace validate out.h5
"""

import sys

import numpy as np

import dsv4


def main(out, config_path, tokens=32, sequences=2):
    with dsv4.TraceWriter(out, config_path, profile="rollout", engine="numpy-example") as w:
        cfg = w.config  # config.json as a dict
        rng = np.random.default_rng(0)
        w.begin_step()
        for s in range(sequences):
            ids = rng.integers(0, cfg["vocab_size"], tokens)
            logprobs = -rng.random(tokens - 1, dtype=np.float32)
            w.add_sequence(ids, logprobs=logprobs, id="request-{}".format(s), prompt_length=tokens // 2)
            k, experts = cfg["num_experts_per_tok"], cfg["n_routed_experts"]
            for layer in range(cfg["num_hidden_layers"]):
                routed = (np.arange(tokens)[:, None] + np.arange(k)[None, :]) % experts
                weights = np.full((tokens, k), 1.0 / k, np.float32)
                w.record_routing(layer, routed, weights)
                if cfg["compress_ratios"][layer] == 4:
                    width = min(cfg["index_topk"], tokens // 4)
                    groups = np.arange(tokens)[:, None] // 4 - 1 - np.arange(width)[None, :]
                    w.record_indexer(layer, np.where(groups >= 0, groups, -1))
        w.end_step()
    print("wrote", out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: write_trace.py OUT.h5 CONFIG.json")
    main(sys.argv[1], sys.argv[2])
