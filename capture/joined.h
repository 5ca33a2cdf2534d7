// Joined traces (traces/FORMAT.md "Joined traces"): the trace of a parallel run in which each rank ran
// and recorded its own sequences. Each rank writes its own trace (a part: no two processes write one
// HDF5 file), and rank 0 writes the joined trace: /meta as any trace's plus /meta/parts (the parts' file
// names, relative to the joined trace's folder), and per step the step's attributes and one HDF5
// external link per sequence to the sequence group in its part. HDF5 follows the links, so h5py and
// every dsv4 command read a joined trace as one trace; the reader checks each part's seal and writer
// marks as it checks the joined file's (capture/trace_open.h).
#pragma once

#include <string>
#include <vector>

#include "capture/step_layout.h"
#include "capture/trace_writer.h"

namespace dsv4 {

// The part of rank `rank` of the joined trace `joined`: "dir/run.h5" -> "dir/run.rank1.h5".
std::string part_trace_path(const std::string& joined, int rank);
// Its file name, as /meta/parts lists it ("run.rank1.h5").
std::string part_trace_name(const std::string& joined, int rank);

// Adds step `index`, of spec `s` (every sequence of the step, in order), to the joined trace `path`,
// sequence i linked to sequence where[i].seq of step `index` of part where[i].part (h.parts names the
// parts; the parts' steps must be complete). Without `append` the trace is created (refused if it
// exists); with it, `path` must be a complete joined trace of the same parts with `index` steps. The
// file is sealed and published like every trace (NAME.h5.incomplete renamed to NAME.h5).
void write_joined_step(const std::string& path, const ModelConfig& c, const TraceHeader& h, int index,
                       const StepSpec& s, const CapturePolicy& policy,
                       const std::vector<StepLayout::PartSeq>& where, bool append);

}  // namespace dsv4
