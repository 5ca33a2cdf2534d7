// HDF5 files whose writes are seen. A file driver that hands every call to HDF5's default driver
// (sec2: POSIX reads and writes on one descriptor) and tells a listener of each write, with the bytes
// written, and of each truncation. The file's bytes are the ones sec2 alone would write: the driver
// reports sec2's features, so HDF5 lays the file out as it does with sec2.
//
// The trace writer hands its writes to the seal (capture/trace_seal.h SealHasher), so that the seal
// at a trace's close reads back only what no write covered instead of the whole file.
#pragma once

#include <hdf5.h>

#include <cstddef>
#include <cstdint>

#include "capture/h5.h"

namespace dsv4::h5 {

class WriteListener {
 public:
  virtual ~WriteListener() = default;
  // `n` bytes of `data` were written at file offset `at` (after the write succeeded, on the thread
  // that made it; HDF5's calls into one file never overlap).
  virtual void wrote(uint64_t at, const void* data, size_t n) = 0;
  // The file was cut or extended to `size` bytes (the bytes past the old end, if any, are zeros).
  virtual void resized(uint64_t size) = 0;
};

// Files created or opened with `fapl` go through the tracking driver and tell `listener` (which must
// outlive them) of their writes; the fapl's file locking settings are kept. False where this HDF5's
// driver interface is not the one the driver is written against (the HDF5 1.10 series): `fapl` is
// then unchanged, and nothing is told.
bool track_writes(hid_t fapl, WriteListener* listener);
// A trace writer's file access list (file_access(true, false)) whose files tell `listener` of their
// writes where track_writes can; elsewhere the listener hears nothing (and the seal reads the file).
Id writing_access(WriteListener* listener);

// The POSIX descriptor HDF5 writes the open file `file` through (sec2, tracked or not), else -1.
int posix_descriptor(hid_t file);

}  // namespace dsv4::h5
