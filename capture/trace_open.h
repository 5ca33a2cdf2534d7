// Opening a trace read-only, with a bounded time on any file, shared by the reader
// (capture/trace_reader.h), validation (capture/validate.h) and salvage (capture/salvage.h).
#pragma once

#include <optional>
#include <string>

#include "capture/h5.h"
#include "capture/trace_seal.h"

namespace dsv4 {

// What the superblock of an HDF5 file says about writers (its "file consistency flags", superblock
// versions 2 and 3; the latest-format files the recorder writes have version 3).
struct WriterMarks {
  bool hdf5 = false;   // an HDF5 signature was found (at offset 0, 512, 1024, ...)
  int version = -1;    // superblock version
  bool write = false;  // marked open for writing (a writer holds the file, or died holding it)
  bool swmr = false;   // marked open for SWMR writing (the recorder during a step's forward)
};
// Reads the superblock's flags with plain file reads (no HDF5 call). Throws TraceError naming the file
// when it cannot be read.
WriterMarks writer_marks(const std::string& path);

// Metadata read attempts of an SWMR-read open (HDF5's default is 100, each a re-read of a piece of
// metadata whose checksum failed). A reader following a live writer needs a few; a damaged file
// must not make every command stall.
constexpr unsigned kSwmrReadAttempts = 4;

// A part of a joined trace (capture/joined.h) as open_for_reading found it.
struct TracePart {
  std::string name;  // as /meta/parts lists it
  std::string path;  // beside the joined trace
  SealCheck seal;
  WriterMarks marks;
};

// An open trace file and how it had to be opened.
struct OpenedTrace {
  h5::Object file;
  bool writer_flag = false;  // the superblock still says "open for writing" (opened with clear_status_flags)
  SealCheck seal;            // the file's seal (capture/trace_seal.h), checked before HDF5 saw the file
  std::vector<TracePart> parts;  // a joined trace's parts; empty for any other trace
};

// Opens a trace read-only. A file whose superblock is not marked open for writing (every closed
// trace) is opened plainly: HDF5 then reads each piece of metadata once and fails at once on a bad
// checksum. Only a file marked open for SWMR writing (a recording in progress, or one killed during
// a step) is opened in SWMR-read mode, with kSwmrReadAttempts read attempts. A file marked open for
// writing outside SWMR mode (a writer that died while laying out a step) is refused with a sentence
// naming `dsv4 trace salvage`, unless `clear_flags` is set: then it is opened with HDF5's
// "clear_status_flags" file-access property, read-only (nothing is written to the file), and
// writer_flag says so. First of all the file's seal is checked (capture/trace_seal.h), with plain file
// reads: under SealPolicy::enforce a file that does not match its seal is refused before HDF5 reads
// any of it. A joined trace's parts (capture/joined.h) get the same checks — each must exist beside it,
// its seal is checked, and the joined file is opened in the mode the most-marked part needs, since HDF5
// opens the parts through the links with the joined file's access mode. Throws TraceError naming the
// file (the part's file for a part).
OpenedTrace open_for_reading(const std::string& path, bool clear_flags = true,
                             SealPolicy seal = SealPolicy::report);

// The reader's refusals for files that are not traces or are newer than this build: rethrown, so
// validate and salvage word them as every other command does. Other failures are left to the
// detailed checks of the caller (the reader may refuse a damaged trace that still has whole steps).
void classify_with_reader(const std::string& path);

// Status of a step group: 1 complete, 0 incomplete, nullopt when unreadable.
std::optional<int> step_status(const h5::Object& step);

// A step group's name: six digits (000000, 000001, ...).
bool is_step_name(const std::string& name);

}  // namespace dsv4
