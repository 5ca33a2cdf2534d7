"""Record what a PyTorch DeepSeek-V4 model decides, with forward hooks (torch is not needed by dsv4).

The hooks see each MoE gate's top-k and each indexer's top-k as the model computes them; the names
below (`.mlp.gate`, `.attn.indexer`, outputs (weights, ids) / ids) follow the reference inference
code: adapt them to your model. One sequence per forward; rows are the tokens fed.
"""

import torch

import dsv4


def record(model, config_path, token_batches, out="torch.h5"):
    seen = {}  # (kind, layer) -> numpy array of the current forward

    def hook(kind, layer):
        def grab(module, inputs, output):
            if kind == "routing":  # gate returns (weights [T, k], ids [T, k])
                seen[kind, layer] = (output[1].cpu().numpy(), output[0].float().cpu().numpy())
            else:  # indexer returns top-k group ids [T, width], -1 where empty
                seen[kind, layer] = output.cpu().numpy()
        return grab

    for name, module in model.named_modules():
        parts = name.split(".")
        if "layers" in parts and name.endswith(("mlp.gate", "attn.indexer")):
            layer = int(parts[parts.index("layers") + 1])
            module.register_forward_hook(hook("routing" if name.endswith("gate") else "indexer", layer))

    with dsv4.TraceWriter(out, config_path, profile="train", kind="train", engine="pytorch") as w:
        w.begin_step()
        for tokens in token_batches:
            seen.clear()
            with torch.no_grad():
                logits = model(torch.tensor([tokens]))[0].float()
            logprobs = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
            w.add_sequence(tokens, logprobs=logprobs.numpy())
            for (kind, layer), value in sorted(seen.items()):
                if kind == "routing":
                    w.record_routing(layer, value[0], value[1])
                else:
                    w.record_indexer(layer, value)
        w.end_step()
