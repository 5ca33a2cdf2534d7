"""Record a PyTorch DeepSeek-V4 model's routing and indexer decisions with forward hooks. The module
names and outputs below (`mlp.gate` -> (weights, ids), `attn.indexer` -> ids, -1 for empty slots)
follow the reference inference code: adapt them to your model. One sequence per forward."""

import re

import torch

import dsv4


def record(model, config_path, sequences, path="torch.h5"):
    seen = {}  # (layer, kind) -> what the module returned in this forward

    def hook(layer, kind):
        return lambda module, inputs, output: seen.__setitem__((layer, kind), output)

    for name, module in model.named_modules():  # "layers.3.mlp.gate", or under a prefix ("model.layers.3...")
        m = re.search(r"(?:^|\.)layers\.(\d+)\.(mlp\.gate|attn\.indexer)$", name)
        if m:
            module.register_forward_hook(hook(int(m.group(1)), "routing" if m.group(2) == "mlp.gate" else "indexer"))

    with dsv4.TraceWriter(path, config_path, profile="train", kind="train", engine="pytorch") as w:
        w.begin_step()
        for tokens in sequences:
            seen.clear()
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([tokens]))[0, :-1].float(), -1)
            w.add_sequence(tokens, logprobs=logp.gather(1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy())
            for (layer, kind), result in sorted(seen.items()):
                if kind == "routing":
                    w.record_routing(layer, result[1].cpu().numpy(), result[0].float().cpu().numpy())
                else:
                    w.record_indexer(layer, result.cpu().numpy())
        w.end_step()
