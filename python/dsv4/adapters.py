"""Importing other engines' R3 data (docs/ADAPTERS.md) from Python: the import `dsv4 import` runs.

    dsv4.import_sglang(["responses.jsonl"], "rollout.h5", preset="flash")
    dsv4.import_miles(["rollout_0.pt"], "rollout.h5", config="flash/config.json")

Both return what the import came to (requests, tokens, notes, the trace written and its size). miles'
``--save-debug-rollout-data`` dumps (``torch.save(dict(rollout_id=..., samples=[Sample.to_dict(),
...]))``) are pickles, which only Python reads: their samples are read here (dsv4.torch_pickle, which
runs none of the file's code) and handed to the same C++ import as the samples of .npz files, member for
member. The rest (.npz, directories of .npy files, SGLang responses) is read by the C++ readers.
"""

import os
import sys
import time

import numpy as np

from . import _dsv4, torch_pickle
from ._dsv4 import InputError

# The Sample fields a sample's R3 data is read from (adapters/miles.h lists the same members).
_MEMBERS = ("tokens", "response_length", "rollout_routed_experts", "rollout_indexer_topk", "rollout_log_probs")


def _require_adapters():
    if not hasattr(_dsv4, "import_r3"):
        raise InputError("dsv4 import: this build has no engine adapters (they need libssl-dev and libzip-dev; "
                         "configure with DSV4_ADAPTERS=ON)")


def _member_array(value, where):
    """A Sample field as the C-contiguous little-endian numpy array the importer reads."""
    if isinstance(value, torch_pickle.Opaque):
        raise InputError("{}: a {} object, not an array".format(where, value._name))
    try:
        a = np.asarray(value)
    except ValueError:  # ragged nested lists
        a = np.empty(0, dtype=object)
    if a.dtype == object:
        raise InputError("{}: not an array of numbers (ragged lists or objects)".format(where))
    if a.dtype.kind in "iu" and a.dtype.itemsize < 4:
        a = a.astype(np.int32)
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return np.ascontiguousarray(a)


def miles_pt_samples(path):
    """The samples of one miles rollout dump, as (index, id, {member: numpy array}): the members of
    _MEMBERS the sample has (None values left out). InputError names the file and the sample."""
    path = os.fspath(path)
    dump = torch_pickle.load(path)
    if isinstance(dump, dict) and "samples" in dump:
        samples = dump["samples"]
    elif isinstance(dump, (list, tuple)):
        samples = dump
    else:
        raise InputError("{}: not a miles rollout dump (expected a dict with 'samples', got {})".format(
            path, type(dump).__name__ if not isinstance(dump, torch_pickle.Opaque) else dump._name))
    if not isinstance(samples, (list, tuple)):
        raise InputError("{}: 'samples' is a {}, not a list".format(path, type(samples).__name__))
    for i, s in enumerate(samples):
        fields = s.fields if isinstance(s, torch_pickle.Opaque) else s  # a Sample object, or Sample.to_dict()
        if not isinstance(fields, dict):
            raise InputError("{}: sample {} is a {}, not a dict of Sample fields".format(path, i, type(s).__name__))
        sid = fields.get("index")
        sid = "" if sid is None else str(sid)
        where = "{}: request {}".format(path, "'{}' (#{})".format(sid, i) if sid else "#{}".format(i))
        members = {}
        for name in _MEMBERS:
            value = fields.get(name)
            if value is not None:
                members[name] = _member_array(value, "{}: {}".format(where, name))
        yield i, sid, members
        del fields, members


def _pt_requests(inputs):
    for path in inputs:
        for index, sid, members in miles_pt_samples(path):
            yield os.fspath(path), index, sid, members


def _model_args(config, model, preset):
    given = [x for x in (config, model, preset) if x is not None]
    if len(given) != 1:
        raise InputError("give exactly one of config=, model= or preset=")
    return (os.fspath(config) if config is not None else "", os.fspath(model) if model is not None else "",
            preset or "")


def _run(engine, inputs, out, config, model, preset, kind, profile, prefix_memory_mb, samples, progress):
    _require_adapters()
    if kind not in ("rollout", "train"):
        raise InputError("kind '{}': expected rollout or train".format(kind))
    return _dsv4.import_r3(engine, [os.fspath(i) for i in inputs], *_model_args(config, model, preset),
                           os.fspath(out), kind, profile, int(prefix_memory_mb), samples, progress)


def import_sglang(inputs, out, *, config=None, model=None, preset=None, kind="rollout", profile="unknown",
                  prefix_memory_mb=1024, progress=None):
    """`dsv4 import sglang`: SGLang responses (JSON or JSONL files) into a new trace `out`. One of
    config= (config.json), model= (checkpoint directory: also checks hash layers) or preset=.
    progress(requests, bytes_read, seconds), when given, is called after each request."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    return _run("sglang", inputs, out, config, model, preset, kind, profile, prefix_memory_mb, None, progress)


def import_miles(inputs, out, *, config=None, model=None, preset=None, kind="rollout", profile="unknown",
                 progress=None):
    """`dsv4 import miles`: miles samples into a new trace `out`: rollout dumps (.pt, read here), or .npz
    files and sample directories (read by the C++ reader); one kind or the other in one import."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    inputs = [os.fspath(i) for i in inputs]
    pt = [i for i in inputs if i.endswith(".pt") and os.path.isfile(i)]
    if pt and len(pt) != len(inputs):
        raise InputError("import miles: give rollout dumps (.pt) or .npz files and sample directories, not both "
                         "in one import ({} and {})".format(pt[0], next(i for i in inputs if i not in pt)))
    samples = _pt_requests(pt) if pt else None
    return _run("miles", inputs, out, config, model, preset, kind, profile, 1024, samples, progress)


class _ProgressLine:
    """One line per second at most on stderr, as `dsv4 import` prints it."""

    def __init__(self, engine):
        self.engine, self.last, self.shown = engine, 0.0, False
        self.tty = sys.stderr.isatty()

    def __call__(self, requests, bytes_read, seconds):
        if seconds - self.last < 1.0:
            return
        self.last, self.shown = seconds, True
        rate = "" if bytes_read <= 0 else ", {:.1f} MB read, {:.1f} MB/s".format(bytes_read / 1e6,
                                                                               bytes_read / 1e6 / max(seconds, 1e-9))
        print("{}import {}: {} requests{}{}".format("\r" if self.tty else "", self.engine, requests, rate,
                                                  "   " if self.tty else ""),
              end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def finish(self):
        if self.shown and self.tty:
            print(file=sys.stderr)


def print_summary(engine, r, seconds=None):
    """The notes and the summary line, as `dsv4 import` prints them."""
    shown = 10
    for note in r["notes"][:shown]:
        print("import {}: note: {}".format(engine, note), file=sys.stderr)
    if len(r["notes"]) > shown:
        print("import {}: note: ... and {} more notes".format(engine, len(r["notes"]) - shown), file=sys.stderr)
    s = r["seconds"] if seconds is None else seconds
    ratio = r["trace_bytes"] / r["int32_bytes"] if r["int32_bytes"] else 0.0
    print("import {}: {} requests, {} tokens in {:.2f} s; {} ({:.1f} MB, {:.3f} of the {:.1f} MB of int32 "
          "buffers)".format(engine, r["requests"], r["tokens"], s, r["trace"], r["trace_bytes"] / 1e6, ratio,
                            r["int32_bytes"] / 1e6), file=sys.stderr)


def main_import(args):
    """`python3 -m dsv4 import sglang|miles ...` (the options of `dsv4 import`)."""
    line = _ProgressLine(args.engine)
    t0 = time.monotonic()
    common = dict(config=args.config, model=args.model, preset=args.preset, kind=args.kind, profile=args.profile,
                  progress=line)
    if args.engine == "sglang":
        r = import_sglang(args.inputs, args.out, prefix_memory_mb=args.prefix_memory, **common)
    else:
        r = import_miles(args.inputs, args.out, **common)
    line.finish()
    print_summary(args.engine, r, time.monotonic() - t0)
    return 0
