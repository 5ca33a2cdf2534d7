"""bfloat16 as numpy holds it without an extra dependency: uint16 arrays of the upper 16 bits of the
float32 pattern, which is how traces store bf16 (traces/FORMAT.md, Conventions)."""

import numpy as np


def bf16_to_float32(bits):
    """Widen bf16 bits (a uint16 array) to float32, exactly."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16:
        raise TypeError("bf16_to_float32: expected a uint16 array of bf16 bits, got dtype {}".format(bits.dtype))
    return (bits.astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16(values):
    """The bf16 bits of float32 values that are bf16-exact (their lower 16 bits are zero).

    Rounding is the engine's business, so inexact values raise ValueError instead of being rounded
    here: a trace records what the engine computed, not an approximation of it."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    wide = values.view(np.uint32)
    inexact = np.flatnonzero(wide & 0xFFFF)
    if inexact.size:
        i = int(inexact[0])
        raise ValueError(
            "float32_to_bf16: element {} ({!r}) is not a bf16 value ({} of {} elements are not)".format(
                i, float(values.reshape(-1)[i]), inexact.size, values.size))
    return (wide >> 16).astype(np.uint16)
