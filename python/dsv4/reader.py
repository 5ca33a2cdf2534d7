"""Reading traces: Trace > Step > Sequence, over the C++ TraceReader.

Opening a trace reads its metadata and step list only. Every record (tokens, a layer's decisions, a
tensor) is read from the file when asked for, and a `rows=` argument reads only those rows. Arrays
are numpy arrays that own the buffer the C++ reader filled (no second copy).
"""

import json
import os
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from . import _dsv4
from .bf16 import bf16_to_float32


def open_trace(path):
    """Open a trace file (NAME.h5). Raises NotATrace, UnsupportedTraceVersion, TraceCorrupt (a file
    that does not match its seal) or TraceError, each naming the file."""
    return Trace(path)


def _row_range(rows, what):
    """(r0, r1) for the reader from rows=None | int | slice(start, stop); r1 = -1 means to the end."""
    if rows is None:
        return 0, -1
    if isinstance(rows, (int, np.integer)) and not isinstance(rows, bool):
        if rows < 0:
            raise IndexError("{}: row {} is negative (rows count from 0)".format(what, rows))
        return int(rows), int(rows) + 1
    if isinstance(rows, slice):
        if rows.step not in (None, 1):
            raise ValueError("{}: rows={!r}: only contiguous slices (step 1) are read".format(what, rows))
        start = 0 if rows.start is None else int(rows.start)
        stop = -1 if rows.stop is None else int(rows.stop)
        if start < 0 or (rows.stop is not None and stop < 0):
            raise ValueError("{}: rows={!r}: negative bounds are not supported (rows count from 0)".format(what, rows))
        if rows.stop is not None and stop < start:
            stop = start
        return start, stop
    raise TypeError("{}: rows must be None, an int or a slice, got {!r}".format(what, rows))


def _one_row(record, rows, what, keys):
    """For rows=int: the record's arrays without their row axis (IndexError when the row is not stored)."""
    if not isinstance(rows, (int, np.integer)) or isinstance(rows, bool):
        return record
    out = dict(record)
    for key in keys:
        if out[key] is not None:
            if len(out[key]) == 0:
                raise IndexError("{}: row {} is not stored".format(what, rows))
            out[key] = out[key][0]
    return out


@dataclass
class Tensor:
    """A full tensor as stored: `values` is uint16 (bf16 bits) for dtype "bf16", float32 for "f32",
    int32 for "i32"; shape[0] is the token (or compressed-group) axis."""

    name: str
    layer: int
    dtype: str
    values: np.ndarray

    @property
    def is_bf16(self):
        return self.dtype == "bf16"

    @property
    def shape(self):
        return self.values.shape

    def float32(self):
        """The values as float32 (bf16 widened exactly; f32 as stored; i32 converted)."""
        if self.is_bf16:
            return bf16_to_float32(self.values)
        return self.values.astype(np.float32, copy=False)

    def __array__(self, dtype=None, copy=None):
        if dtype is None and not copy:
            return self.values
        return self.values.astype(self.values.dtype if dtype is None else dtype)


@dataclass
class Digests:
    """The per-row digests of a sequence, in execution order: record i is tensor names[i] of layer
    layers[i], whose rows[i] digests are values[first[i] : first[i] + rows[i]] (uint64)."""

    names: List[str]
    layers: np.ndarray
    rows: np.ndarray
    first: np.ndarray
    values: np.ndarray

    def __len__(self):
        return len(self.names)

    def of(self, name, layer=-1):
        """The digests of one tensor (uint64 [rows]); KeyError when the sequence has no such record."""
        for i, (n, l) in enumerate(zip(self.names, self.layers)):
            if n == name and l == layer:
                return self.values[self.first[i]:self.first[i] + self.rows[i]]
        raise KeyError("no digest record for tensor {!r} layer {}".format(name, layer))


class Sequence:
    """One sequence of a step: tokens, log-probs, decisions per layer, digests and full tensors."""

    def __init__(self, step, index):
        self.step = step
        self.index = index
        self._where = "{} step {} sequence {}".format(step.trace.path, step.index, index)

    def __repr__(self):
        return "<dsv4.Sequence {} ({} tokens)>".format(self._where, self.length)

    @property
    def _reader(self):
        return self.step.trace._open_reader()

    @property
    def length(self):
        return int(self.step.seq_lengths[self.index])

    @property
    def tokens(self):
        """int32 [T]: prompt and response, as fed."""
        return self._reader.tokens(self.step.index, self.index)

    @property
    def logprobs(self):
        """float32 [T - 1] (logprobs[t] = log p(tokens[t + 1])), or None when the step holds none."""
        if not self._reader.has_logprobs(self.step.index, self.index):
            return None
        return self._reader.logprobs(self.step.index, self.index)

    @property
    def id(self):
        """The engine's request id of an external step ("" otherwise)."""
        return self._reader.sequence_id(self.step.index, self.index)

    @property
    def prompt_length(self):
        """The prompt length an external step recorded, or None when unknown."""
        p = self._reader.prompt_length(self.step.index, self.index)
        return None if p < 0 else p

    @property
    def layers(self):
        """The layers that hold decisions."""
        return list(self._reader.decision_layers(self.step.index, self.index))

    def _layer_label(self, what, layer):
        return "{} layer {} {}".format(self._where, layer, what)

    def indexer(self, layer, rows=None):
        """Indexer top-k of a C4 layer: {"ids": int32 [R, width] (-1 pads), "margin": float32 [R] or
        None}. rows: None (all), an int (that row, without the row axis) or a slice. None when the
        layer has no indexer record."""
        what = self._layer_label("indexer", layer)
        r0, r1 = _row_range(rows, what)
        rec = self._reader.indexer(self.step.index, self.index, layer, r0, r1)
        return None if rec is None else _one_row(rec, rows, what, ("ids", "margin"))

    def routing(self, layer, rows=None):
        """MoE routing of a layer: {"ids": int32 [R, k], "weights": float32 [R, k] or None, "margin":
        float32 [R] or None, "hashed": bool}. rows as for indexer(). None when the layer has no routing
        record."""
        what = self._layer_label("routing", layer)
        r0, r1 = _row_range(rows, what)
        rec = self._reader.routing(self.step.index, self.index, layer, r0, r1)
        return None if rec is None else _one_row(rec, rows, what, ("ids", "weights", "margin"))

    def mhc(self, layer, sublayer):
        """mHC mixing of sublayer "attn" or "ffn": {"pre": [T, hc], "post": [T, hc], "comb": [T, hc, hc]}
        float32, or None when not recorded."""
        return self._reader.mhc(self.step.index, self.index, layer, sublayer)

    def digests(self):
        """The per-row digests of every named tensor, in execution order (Digests)."""
        d = self._reader.digests(self.step.index, self.index)
        return Digests(d["names"], d["layers"], d["rows"], d["first"], d["values"])

    def tensors(self):
        """The (name, layer) pairs of the full tensors the capture policy kept."""
        return [tuple(t) for t in self._reader.full_tensors(self.step.index, self.index)]

    def tensor(self, name, layer=-1, rows=None):
        """A full tensor (Tensor), or rows of it (rows as for indexer(); an int drops the row axis).
        KeyError naming the stored tensors when it was not kept."""
        what = self._layer_label("tensor " + name, layer)
        r0, r1 = _row_range(rows, what)
        rec = self._reader.tensor(self.step.index, self.index, layer, name, r0, r1)
        if rec is None:
            stored = ", ".join("{}@{}".format(n, l) for n, l in self.tensors()) or "none"
            raise KeyError("{}: not stored (stored: {})".format(what, stored))
        rec = _one_row(rec, rows, what, ("values",))
        return Tensor(name, layer, rec["dtype"], rec["values"])


class Step:
    """One step of a trace: its attributes (index, kind, profile, engine, source, capture, seed,
    complete, seq_lengths, ...) and its sequences."""

    def __init__(self, trace, info):
        self.trace = trace
        self.index = info["index"]
        self.kind = info["kind"]
        self.profile = info["profile"]
        # The recorded profile's canonical text (docs/PROFILES.md); "" for steps that store only a name.
        self.profile_text = info["profile_text"]
        self.capture = info["capture"]
        self.seed = info["seed"]
        self.threads = info["threads"]
        self.complete = info["complete"]
        self.damage = info["damage"]
        self.why_not_complete = info["why_not_complete"]
        self.seq_lengths = list(info["seq_lengths"])
        self.engine = info["engine"]  # external steps: who computed it ("" for our runtime)
        self.source = info["source"]

    @property
    def external(self):
        return bool(self.engine)

    def __repr__(self):
        state = "complete" if self.complete else self.why_not_complete
        return "<dsv4.Step {} of {}: {} {} ({} sequences, {})>".format(
            self.index, self.trace.path, self.kind, self.profile, len(self.seq_lengths), state)

    def __len__(self):
        return len(self.seq_lengths)

    def seq(self, j):
        """Sequence j of the step's batch."""
        if not 0 <= j < len(self.seq_lengths):
            raise IndexError("{}: step {} has no sequence {} (it has {})".format(
                self.trace.path, self.index, j, len(self.seq_lengths)))
        return Sequence(self, j)

    @property
    def sequences(self):
        return [Sequence(self, j) for j in range(len(self.seq_lengths))]

    def generation(self):
        """A generation step's record (kind "generate"), else None: the engine's settings (max_batch,
        page_size, prefill_chunk, token_budget, prefix_sharing, decode_attention), "requests" (per
        request: id, prompt_length, sampling settings, the generated "tokens" and their "logprobs",
        the Philox "counters" [n, 4], finish_reason, prefix_source, shared_prefix) and "schedule"
        (parallel arrays step, request, pos0, length, sampled; execution order)."""
        return self.trace._open_reader().generation(self.index)

    def training(self):
        """A training step's record (kind "train-step"), else None: "settings" (dict), the optimizer's
        provenance, per sample its loss inputs, "metrics", per weight its row digests ("params": name ->
        grad, weight, master, m, v as uint64 arrays; None where not trained), the activation-gradient
        digests ("act_grads") and the full gradients and weights the capture policy kept."""
        rec = self.trace._open_reader().training(self.index)
        if rec is not None:
            rec["settings"] = json.loads(rec["settings_json"])
        return rec

    def kernels(self):
        """The GPU kernel records of the step: "available" (False: "reason" says why, e.g. a CPU run),
        and per kernel in launch order "names", "grid" / "block" [n, 3], "shared_bytes", "registers",
        "stream", "start_ns", "end_ns", "correlation"."""
        return self.trace._open_reader().kernels(self.index)


class Trace:
    """An open trace. `steps`, `env` and `model` come from the metadata read at open; records are read
    on demand through Step.seq(j)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        self._reader = _dsv4.TraceReader(self.path)
        self.format_version = self._reader.format_version
        self.producer = self._reader.producer
        self.created = self._reader.created
        self.seal = self._reader.seal
        self.steps = [Step(self, s) for s in self._reader.steps()]

    def __repr__(self):
        return "<dsv4.Trace {} (format {}, {} steps)>".format(self.path, self.format_version, len(self.steps))

    def __len__(self):
        return len(self.steps)

    def __iter__(self):
        return iter(self.steps)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self):
        """Release the file (a Trace also releases it when garbage-collected). Reading a record of a
        closed trace raises dsv4.TraceError."""
        self._reader = None

    def _open_reader(self):
        if self._reader is None:
            raise _dsv4.TraceError("{}: the trace is closed".format(self.path))
        return self._reader

    def refresh(self):
        """Re-read the step list (a trace that is still being written)."""
        self._open_reader().refresh()
        self.steps = [Step(self, s) for s in self._reader.steps()]

    def step(self, i):
        if not 0 <= i < len(self.steps):
            raise IndexError("{}: no step {} (the trace has {})".format(self.path, i, len(self.steps)))
        return self.steps[i]

    @property
    def env(self):
        """The environment fingerprint recorded with the trace (dict of strings)."""
        return dict(self._open_reader().env())

    @property
    def model(self):
        """{"config": dict, "config_json": str, "digest": str, "weights_path": str, "tensor_names":
        [str], "tensor_digests": uint64 array}."""
        m = self._open_reader().model()
        m["config"] = json.loads(m["config_json"])
        return m
