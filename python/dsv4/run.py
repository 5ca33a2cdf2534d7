"""forward, replay and diff: the dicts the CLI writes as JSON for the same input (`dsv4 forward`,
`dsv4 replay --json`, `dsv4 diff --json`; docs/DIFF_JSON.md), produced by the same library code."""

import json
import os

from . import _dsv4


def forward(tokens, model=None, preset=None, seed=0, profile="train", threads=0, temperature=1.0):
    """One sequence through the model (a checkpoint directory `model`, or a built-in `preset` with
    seeded weights): {"profile", "tokens", "logprobs", "indexer_topk": [{"layer", "sets"}],
    "experts": [{"layer", "hashed", "ids"}]}."""
    text = _dsv4.forward_json("" if model is None else os.fspath(model), preset or "", int(seed),
                              [int(t) for t in tokens], profile, int(threads), float(temperature))
    return json.loads(text)


def _force_kinds(force):
    kinds = force.split(",") if isinstance(force, str) else list(force)
    unknown = [k for k in kinds if k not in ("indexer", "routing", "")]
    if unknown:
        raise ValueError("force: unknown kind {!r} (expected indexer, routing)".format(unknown[0]))
    return "indexer" in kinds, "routing" in kinds


def replay(trace, step=None, model=None, threads=0, force=(), take_decisions_from=None, take_step=-1,
           optimizer_state=None, tolerance=None, tolerance_logprobs=None):
    """Re-execute the trace's steps (or one `step`) and compare with the recording; the report
    `dsv4 replay --json` writes. force: "indexer", "routing" or both (the recorded decisions fed back).
    tolerance (`dsv4 replay --tolerance`): None refuses a fast-numerics step that cannot be replayed bit
    for bit here; True compares it within the default bounds (docs/NUMERICS.md "Replay within
    tolerance"); a number is the per-tensor rel-L2 bound. tolerance_logprobs
    (`--tolerance-logprobs`, with tolerance): the log-probs' rel-L2 bound."""
    force_indexer, force_routing = _force_kinds(force)
    if tolerance is None or tolerance is False:
        if tolerance_logprobs is not None:
            raise ValueError("tolerance_logprobs needs tolerance (it sets one of its bounds)")
        tol = None
    elif tolerance is True:
        tol = ""
    else:
        tol = repr(float(tolerance))
    text = _dsv4.replay_json(os.fspath(trace), step, "" if model is None else os.fspath(model), int(threads),
                             force_indexer, force_routing,
                             "" if take_decisions_from is None else os.fspath(take_decisions_from),
                             int(take_step), "" if optimizer_state is None else os.fspath(optimizer_state), tol,
                             "" if tolerance_logprobs is None else repr(float(tolerance_logprobs)))
    return json.loads(text)


def diff(a, b, step_a=0, step_b=0, allow_model_mismatch=False, tie_threshold=None):
    """Compare trace B (candidate) with trace A (reference); the report `dsv4 diff --json` writes."""
    text = _dsv4.diff_json(os.fspath(a), os.fspath(b), int(step_a), int(step_b), bool(allow_model_mismatch),
                           -1.0 if tie_threshold is None else float(tie_threshold))
    return json.loads(text)
