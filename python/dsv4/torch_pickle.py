"""Reading files written by torch.save without torch and without running their code.

torch.save (PyTorch 1.6 and later) writes a zip archive: ``NAME/data.pkl``, a pickle of the saved
object whose tensors refer to their storages by key (persistent ids), the storages as raw bytes
``NAME/data/KEY``, and ``NAME/byteorder`` ("little" or "big"; absent means little).

A pickle may name any importable callable, and ``torch.load`` (without ``weights_only``) calls what it
names. This reader calls only what it knows to be harmless:

* torch's tensor rebuilders (``torch._utils._rebuild_tensor_v2`` / ``_v3``) and storage and dtype
  names: a tensor becomes a numpy array over its storage's bytes (bfloat16 as its uint16 bits);
* numpy's array, dtype and scalar reconstructors (numpy arrays pickled inline, as miles saves its
  Sample arrays), and ``_codecs.encode`` (how protocol 2 pickles hold bytes);
* ``collections.OrderedDict``, ``builtins.set``, ``frozenset``, ``complex``, ``slice``, ``torch.Size``.

Any other class or function (a dataclass of the program that saved the file, an enum, ...) is replaced
by an inert ``Opaque`` object that remembers its name, the arguments and the state it was given;
``getattr`` (how enums are pickled) is answered only on those stand-ins. Nothing outside this list runs.

Legacy files (``torch.save(..., _use_new_zipfile_serialization=False)``, not a zip archive) are
refused with a message saying so.
"""

import collections
import io
import os
import pickle
import zipfile

import numpy as np

from ._dsv4 import InputError


class Opaque:
    """Stands for an object of a class this reader does not construct: its pickled name and contents."""

    _name = "?"

    def __init__(self, *args, **kwargs):
        self.args = args
        self.kwargs = kwargs
        self.state = None

    def __setstate__(self, state):
        self.state = state

    def __repr__(self):
        return "<{} (not constructed){}>".format(self._name, "" if self.state is None else " " + repr(self.state))

    @property
    def fields(self):
        """The pickled state as a dict where it is one (a dataclass's fields), else {}."""
        s = self.state
        if isinstance(s, tuple) and len(s) == 2 and s[0] is None:  # (None, slots) of a frozen dataclass
            s = s[1]
        return dict(s) if isinstance(s, dict) else {}


def _opaque_class(module, name):
    return type(name, (Opaque,), {"_name": "{}.{}".format(module, name), "__module__": "dsv4.torch_pickle"})


class _Member(Opaque):
    """getattr(stand-in class, name): an enum member, for instance."""


def _safe_getattr(obj, name, *default):
    if isinstance(obj, type) and issubclass(obj, Opaque):
        m = _Member()
        m._name = "{}.{}".format(obj._name, name)
        return m
    raise pickle.UnpicklingError("getattr on {!r} is not allowed in a dsv4 read of a torch file".format(obj))


# torch's storage classes and dtypes → numpy dtypes (bfloat16 as its bits).
_STORAGES = {
    "DoubleStorage": np.float64, "FloatStorage": np.float32, "HalfStorage": np.float16,
    "BFloat16Storage": np.uint16, "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
    "UntypedStorage": np.uint8,
}
_DTYPES = {
    "float64": np.float64, "double": np.float64, "float32": np.float32, "float": np.float32,
    "float16": np.float16, "half": np.float16, "bfloat16": np.uint16, "int64": np.int64, "long": np.int64,
    "int32": np.int32, "int": np.int32, "int16": np.int16, "short": np.int16, "int8": np.int8,
    "uint8": np.uint8, "bool": np.bool_,
}


class _StorageType:
    def __init__(self, name, dtype):
        self.name, self.dtype = name, np.dtype(dtype)


class _TorchDtype:
    def __init__(self, name, dtype):
        self.name, self.dtype = name, np.dtype(dtype)


class _Storage:
    """A storage's bytes as a 1-D numpy array of its element type."""

    def __init__(self, values):
        self.values = values


def _rebuild_tensor(storage, offset, size, stride, *rest, dtype=None):
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("a tensor without a storage")
    values = storage.values
    if dtype is not None and values.dtype != dtype:
        values = values.view(dtype) if values.dtype == np.uint8 else values.astype(dtype)
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    if len(size) != len(stride) or offset < 0 or any(s < 0 for s in size) or any(s < 0 for s in stride):
        raise pickle.UnpicklingError("tensor of size {} and stride {} at offset {}".format(size, stride, offset))
    if 0 not in size:
        last = offset + sum((n - 1) * s for n, s in zip(size, stride))
        if last >= len(values):
            raise pickle.UnpicklingError("tensor of size {} and stride {} at offset {} reaches element {} of a "
                                         "storage of {}".format(size, stride, offset, last, len(values)))
    item = values.itemsize
    view = np.lib.stride_tricks.as_strided(values[offset:] if len(values) else values, shape=size,
                                           strides=tuple(s * item for s in stride), writeable=False)
    return np.array(view, order="C")  # a copy, C order


def _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    return _rebuild_tensor(storage, offset, size, stride, dtype=dtype.dtype if isinstance(dtype, _TorchDtype) else None)


def _reconstructor(cls, base, state):
    if isinstance(cls, type) and issubclass(cls, Opaque):
        return cls()
    raise pickle.UnpicklingError("copyreg._reconstructor of {!r} is not allowed".format(cls))


_ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("builtins", "complex"): complex,
    ("builtins", "slice"): slice, ("builtins", "getattr"): _safe_getattr,
    ("copyreg", "_reconstructor"): _reconstructor,
    ("_codecs", "encode"): lambda text, encoding="utf-8": text.encode(encoding),
    ("torch._utils", "_rebuild_tensor"): lambda storage, offset, size, stride: _rebuild_tensor(storage, offset,
                                                                                                size, stride),
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
    ("torch", "Size"): tuple,
}
for _m in ("numpy.core.multiarray", "numpy._core.multiarray"):
    _ALLOWED[(_m, "_reconstruct")] = np.core.multiarray._reconstruct
    _ALLOWED[(_m, "scalar")] = np.core.multiarray.scalar
_ALLOWED[("numpy", "ndarray")] = np.ndarray
_ALLOWED[("numpy", "dtype")] = np.dtype


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, storages):
        super().__init__(file, encoding="latin1")
        self._storages = storages  # key → numpy array (read on first use)
        self._kinds = {}

    def find_class(self, module, name):
        if module == "__builtin__":
            module = "builtins"
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and name in _STORAGES:
            return _StorageType(name, _STORAGES[name])
        if module == "torch" and name in _DTYPES:
            return _TorchDtype(name, _DTYPES[name])
        if module == "numpy" and name in ("int32", "int64", "float32", "float64", "bool_", "uint8", "int8", "int16", "float16"):
            return getattr(np, name)
        return _opaque_class(module, name)

    def persistent_load(self, pid):
        if not isinstance(pid, tuple) or len(pid) < 5 or pid[0] != "storage":
            raise pickle.UnpicklingError("unknown persistent id {!r}".format(pid))
        kind, key, numel = pid[1], str(pid[2]), int(pid[4])
        dtype = kind.dtype if isinstance(kind, (_StorageType, _TorchDtype)) else np.dtype(np.uint8)
        values = self._storages(key, dtype)
        if len(values) < numel:
            raise pickle.UnpicklingError("storage {} holds {} values, the pickle says {}".format(key, len(values), numel))
        return _Storage(values[:numel])


def load(path):
    """The object torch.save wrote to `path`: dicts, lists and plain values as themselves, tensors and
    numpy arrays as numpy arrays, other objects as Opaque stand-ins. InputError names the file when it
    is not a torch.save archive or does not read."""
    path = os.fspath(path)
    try:
        z = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        with open(path, "rb") as f:
            head = f.read(2)
        if head[:1] == b"\x80":
            raise InputError("{}: a legacy torch.save file (not a zip archive; written with "
                             "_use_new_zipfile_serialization=False): load it with torch and save it again "
                             "with torch.save's default".format(path)) from None
        raise InputError("{}: not a torch.save file (not a zip archive)".format(path)) from None
    except OSError as e:
        raise InputError("{}: cannot read ({})".format(path, e.strerror)) from None
    with z:
        names = z.namelist()
        pkl = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise InputError("{}: not a torch.save archive (no single data.pkl among {} members)".format(path, len(names)))
        prefix = pkl[0][: -len("data.pkl")]
        big = False
        if prefix + "byteorder" in names:
            big = z.read(prefix + "byteorder").strip() == b"big"

        cache = {}

        def storage(key, dtype):
            if (key, dtype) in cache:
                return cache[(key, dtype)]
            member = prefix + "data/" + key
            if member not in names:
                raise pickle.UnpicklingError("storage {} is not in the archive".format(key))
            raw = z.read(member)
            if len(raw) % dtype.itemsize:
                raise pickle.UnpicklingError("storage {}: {} bytes are not a whole number of {}".format(key, len(raw), dtype))
            values = np.frombuffer(raw, dtype=dtype.newbyteorder(">") if big else dtype)
            cache[(key, dtype)] = values.astype(dtype) if big else values
            return cache[(key, dtype)]

        try:
            return _Unpickler(io.BytesIO(z.read(pkl[0])), storage).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError) as e:
            raise InputError("{}: {}: cannot read the pickle: {}".format(path, pkl[0], e)) from None
        except zipfile.BadZipFile as e:
            raise InputError("{}: a damaged zip archive: {}".format(path, e)) from None
