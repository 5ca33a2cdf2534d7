// Opening a trace that may be damaged (a recorder that died, a file from elsewhere), shared by
// validation (capture/validate.h) and salvage (capture/salvage.h).
#pragma once

#include <optional>
#include <string>

#include "capture/h5.h"

namespace dsv4 {

// An open trace file and how it had to be opened.
struct OpenedTrace {
  h5::Object file;
  bool writer_flag = false;  // the superblock still says "open for writing" (opened with clear_status_flags)
};

// Opens a trace read-only, most permissive last:
//  1. SWMR read: a closed file, or one whose writer is (or died) in SWMR-write mode;
//  2. plain read: an HDF5 file written without the latest format (not one of ours, but readable);
//  3. read with HDF5's "clear_status_flags" file-access property: a file whose writer died while it
//     held the file outside SWMR mode (creating a step's groups and datasets). Its superblock still
//     marks it open for writing and HDF5 refuses it otherwise. Read-only, the flags are ignored for
//     this open and nothing is written to the file (`h5clear -s` would rewrite the superblock).
// Throws TraceError with the first attempt's error when none works.
OpenedTrace open_for_reading(const std::string& path);

// The reader's refusals for files that are not traces or are newer than this build: rethrown, so
// validate and salvage word them as every other command does. Other failures are left to the
// detailed checks of the caller (the reader may refuse a damaged trace that still has whole steps).
void classify_with_reader(const std::string& path);

// Status of a step group: 1 complete, 0 incomplete, nullopt when unreadable.
std::optional<int> step_status(const h5::Object& step);

// A step group's name: six digits (000000, 000001, ...).
bool is_step_name(const std::string& name);

}  // namespace dsv4
