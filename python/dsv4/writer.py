"""Writing a trace from an engine: TraceWriter over the C++ ExternalTraceWriter.

The steps it writes are *external steps* (traces/FORMAT.md): decisions, log-probs and tensors that
another engine computed, in the same file format, with the same checks and the same crash safety as
the writers of the dsv4 tools. The file is NAME.h5.incomplete until close(); a step that was begun
and not ended stays incomplete (status 0), as after a crash.
"""

import json
import os

import numpy as np

from . import _dsv4
from ._dsv4 import InputError

# The dtype names the trace uses, and the spellings accepted for them.
_DTYPES = {"f32": "f32", "float32": "f32", "bf16": "bf16", "bfloat16": "bf16", "i32": "i32", "int32": "i32"}


def _config_text(model_config):
    """config.json text from a path, a JSON string or a dict."""
    if isinstance(model_config, dict):
        return json.dumps(model_config)
    if isinstance(model_config, (str, os.PathLike)):
        text = os.fspath(model_config)
        if text.lstrip().startswith("{"):
            return text
        path = os.path.join(text, "config.json") if os.path.isdir(text) else text
        try:
            with open(path, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise InputError("model_config {}: cannot read it ({})".format(path, e.strerror)) from None
    raise TypeError("model_config: expected a path to config.json, a JSON string or a dict, got {}".format(
        type(model_config).__name__))


def _int32(values, what):
    """An int32 array of integer values, refusing floats and values int32 cannot hold (no silent casts)."""
    a = np.asarray(values)
    if a.size == 0:
        return np.ascontiguousarray(a, dtype=np.int32)
    if a.dtype.kind not in "iu":
        raise InputError("{}: expected integers, got an array of dtype {}".format(what, a.dtype))
    lo, hi = a.min(), a.max()
    if lo < np.iinfo(np.int32).min or hi > np.iinfo(np.int32).max:
        bad = lo if lo < np.iinfo(np.int32).min else hi
        raise InputError("{}: value {} does not fit in int32".format(what, bad))
    return np.ascontiguousarray(a, dtype=np.int32)


def _float32(values, what):
    a = np.asarray(values)
    if a.dtype.kind not in "fiu":
        raise InputError("{}: expected real numbers, got an array of dtype {}".format(what, a.dtype))
    return np.ascontiguousarray(a, dtype=np.float32)


def _matrix(a, what):
    if a.ndim != 2:
        raise InputError("{}: expected a 2-D array [rows, width], got shape {}".format(what, a.shape))
    return a


class TraceWriter:
    """Writes engine-computed steps into a new trace at `path` (NAME.h5; refuses to overwrite).

    model_config: the model's config.json as a path (file or checkpoint directory), a JSON string or
    a dict. kind: "rollout" (an inference engine) or "train" (a trainer's forward). profile: the
    numerics profile of ours that describes the engine, if any. engine: who computed the steps.
    weights_path, model_digest, weight_names, weight_digests: the weights the engine ran, when known
    (a trace's `model` dict holds them as weights_path, digest, tensor_names, tensor_digests); the
    digest must agree with the per-weight digests, in the config's weight order.

    Per step: begin_step(), then per sequence add_sequence(...) followed by its record_*() calls, then
    end_step(). A sequence is checked and written when the next add_sequence() or end_step() comes;
    errors raise InputError naming the sequence, the layer and the row, nothing of that sequence is
    written, and the call that raised did not start its own sequence (call it again). A layer out of
    range or an array of the wrong kind raises at the record_*() call already.

    Used as a context manager, the trace is closed when the block ends normally and left as
    NAME.h5.incomplete when it raises (or ends with a step still open, which raises dsv4.Error).
    """

    def __init__(self, path, model_config, profile="unknown", kind="rollout", engine="python", source="",
                 weights_path="", model_digest="", weight_names=(), weight_digests=()):
        text = _config_text(model_config)
        names = [str(n) for n in weight_names]
        digests = [int(d) for d in np.asarray(weight_digests, dtype=np.uint64).reshape(-1)]
        self._w = _dsv4.ExternalTraceWriter(os.fspath(path), text, os.fspath(weights_path), model_digest, names,
                                            digests)
        self.config = json.loads(text)  # the model's config.json as a dict (it parsed in C++ already)
        self._num_layers = self._w.num_hidden_layers
        self.kind, self.profile, self.engine, self.source = kind, profile, engine, source
        self._step_open = False
        self._seq = None  # the sequence being assembled (an _dsv4.ExternalSequence)

    @property
    def path(self):
        """The final name of the trace (it is NAME.h5.incomplete until close())."""
        return self._writer("path").final_path

    @property
    def steps_written(self):
        return self._writer("steps_written").steps_written

    def _writer(self, what):
        if self._w is None:
            raise InputError("TraceWriter.{}: the writer is closed".format(what))
        return self._w

    def begin_step(self, kind=None, profile=None, engine=None, source=None):
        """Start a step; the arguments override the writer's for this step."""
        w = self._writer("begin_step")
        if self._step_open:
            raise InputError("begin_step: step {} is still open (call end_step first)".format(w.steps_written))
        w.begin_step(kind or self.kind, engine or self.engine, profile or self.profile,
                     self.source if source is None else source)
        self._step_open = True

    def add_sequence(self, tokens, logprobs=None, id="", prompt_length=None):
        """Start a sequence of the open step: its tokens (prompt + response, as fed), optionally its
        log-probs (T - 1 values: logprobs[t] = log p(tokens[t + 1])), request id and prompt length."""
        self._need_step("add_sequence")
        self._flush()
        tokens = _int32(tokens, "add_sequence({!r}): tokens".format(id))
        if tokens.ndim != 1:
            raise InputError("add_sequence({!r}): tokens must be 1-D, got shape {}".format(id, tokens.shape))
        lp = None if logprobs is None else _float32(logprobs, "add_sequence({!r}): logprobs".format(id)).reshape(-1)
        self._seq = _dsv4.ExternalSequence(str(id), tokens, -1 if prompt_length is None else int(prompt_length), lp)

    def record_indexer(self, layer, rows):
        """Indexer top-k of a C4 layer: int [rows, width], a row per token (T or T - 1 rows) holding
        compressed-group positions in any order, -1 for empty slots."""
        what = "record_indexer(layer {})".format(layer)
        seq = self._need_seq(what)
        seq.add_indexer(self._layer(layer, what), _matrix(_int32(rows, what), what))

    def record_routing(self, layer, ids, weights=None):
        """MoE routing of a layer: expert ids int [rows, k] (any order within a row) and, when the
        engine reports them, their weights [rows, k] in the same order."""
        what = "record_routing(layer {})".format(layer)
        seq = self._need_seq(what)
        ids = _matrix(_int32(ids, what + " ids"), what + " ids")
        w = None if weights is None else _matrix(_float32(weights, what + " weights"), what + " weights")
        seq.add_routing(self._layer(layer, what), ids, w)

    def record_tensor(self, name, layer, array, dtype=None):
        """A tensor the engine computed; shape[0] is the token axis; layer -1 for model-level tensors.
        dtype "f32" | "bf16" | "i32" (default: from the array: float32 -> f32, uint16 -> bf16 bits,
        integers -> i32). bf16 values may be given as uint16 bits or as bf16-exact float32 values."""
        what = "record_tensor({!r}, layer {})".format(name, layer)
        seq = self._need_seq(what)
        a = np.asarray(array)
        if dtype is None:
            dtype = "bf16" if a.dtype == np.uint16 else "i32" if a.dtype.kind in "iu" else "f32"
        if dtype not in _DTYPES:
            raise InputError("{}: dtype {!r}: expected f32, bf16 or i32".format(what, dtype))
        dtype = _DTYPES[dtype]
        if a.ndim < 1:
            raise InputError("{}: expected an array with a token axis, got a scalar".format(what))
        if dtype == "i32":
            a = _int32(a, what)
        elif not (dtype == "bf16" and a.dtype == np.uint16):
            a = _float32(a, what)
        layer = layer if layer == -1 else self._layer(layer, what)
        seq.add_tensor(str(name), layer, dtype, np.ascontiguousarray(a))

    def end_step(self):
        """Write the last sequence and mark the step complete."""
        w = self._writer("end_step")
        self._need_step("end_step")
        self._flush()
        w.end_step()
        self._step_open = False

    def close(self):
        """Seal the file and give it its final name. Idempotent. Raises dsv4.Error while a step is open
        (end it first, or abandon() the trace)."""
        if self._w is None:
            return
        self._w.close()
        self._w = None

    def abandon(self):
        """Stop without closing, as a crash would: the file keeps its .incomplete name."""
        self._seq = None
        self._w = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            try:
                self.close()
            except Exception:
                self.abandon()  # e.g. a step left open: the trace stays .incomplete, as after a crash
                raise
        else:
            self.abandon()
        return False

    def _need_step(self, what):
        self._writer(what)
        if not self._step_open:
            raise InputError("{}: no step is open (call begin_step first)".format(what))

    def _need_seq(self, what):
        self._need_step(what)
        if self._seq is None:
            raise InputError("{}: no sequence (call add_sequence first)".format(what))
        return self._seq

    def _layer(self, layer, what):
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise InputError("{}: layer must be an int".format(what))
        if not 0 <= layer < self._num_layers:
            raise InputError("{}: layer {} is out of range [0, {})".format(what, layer, self._num_layers))
        return int(layer)

    def _flush(self):
        seq, self._seq = self._seq, None
        if seq is not None:
            self._w.add_sequence(seq)
