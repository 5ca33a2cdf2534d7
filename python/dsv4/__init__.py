"""dsv4: read, write, replay and compare DeepSeek-V4 traces from Python.

    trace = dsv4.open_trace("run.h5")           # lazy: reads metadata only
    seq = trace.step(0).seq(0)
    seq.indexer(layer=2, rows=slice(10, 20))    # {"ids": int32 [10, width], "margin": float32 [10]}
    seq.routing(layer=3)["ids"]                 # int32 [T, k]

    with dsv4.TraceWriter("engine.h5", "model/config.json", profile="rollout") as w:
        w.begin_step()
        w.add_sequence(tokens, logprobs=lp)
        w.record_routing(layer, ids, weights)
        w.end_step()

    dsv4.replay("run.h5")                       # the dict `dsv4 replay --json` writes
    dsv4.diff("train.h5", "rollout.h5")         # the dict `dsv4 diff --json` writes
    dsv4.forward([1, 2, 3], preset="tiny")      # the dict `dsv4 forward` prints
    dsv4.import_miles(["rollout_0.pt"], "r.h5", preset="flash")   # `dsv4 import`, .pt dumps too

The reference is docs/PYTHON.md.
"""

try:
    from . import _dsv4
except ImportError as e:  # the pure-Python files without the compiled half
    raise ImportError(
        "dsv4: the extension module _dsv4 is missing or does not load ({}). Build it with CMake "
        "(DSV4_PYTHON=ON, needs pybind11-dev) and import the package from build/python, or install it "
        "with `cmake --install build --component python`".format(e)
    ) from e

from ._dsv4 import (
    ConfigError,
    Error,
    InputError,
    NotATrace,
    OverrideError,
    TraceCorrupt,
    TraceError,
    TraceIncomplete,
    UnsupportedTraceVersion,
    WeightsError,
)
from .adapters import import_miles, import_sglang
from .bf16 import bf16_to_float32, float32_to_bf16
from .reader import Digests, Sequence, Step, Tensor, Trace, open_trace
from .run import diff, forward, replay
from .writer import TraceWriter

__version__ = _dsv4.__version__

# The exceptions are defined by the extension module; tracebacks name them as the package exports them.
for _exc in (ConfigError, Error, InputError, NotATrace, OverrideError, TraceCorrupt, TraceError, TraceIncomplete,
             UnsupportedTraceVersion, WeightsError):
    _exc.__module__ = "dsv4"
del _exc

__all__ = [
    "ConfigError", "Digests", "Error", "InputError", "NotATrace", "OverrideError", "Sequence", "Step",
    "Tensor", "Trace", "TraceCorrupt", "TraceError", "TraceIncomplete", "TraceWriter",
    "UnsupportedTraceVersion", "WeightsError", "bf16_to_float32", "diff", "float32_to_bf16", "forward",
    "import_miles", "import_sglang", "open_trace", "replay",
]
