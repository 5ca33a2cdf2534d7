#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/communicator.h"
#include "model/config.h"
#include "model/weights.h"

namespace dsv4::cli {

std::string version_string();
void register_model_commands(CLI::App& app);
void register_forward_commands(CLI::App& app);
void register_generate_command(CLI::App& app);
void register_train_command(CLI::App& app);
void register_trace_commands(CLI::App& app);
void register_replay_commands(CLI::App& app);
void register_bundle_command(CLI::App& trace);
void register_adapter_commands(CLI::App& app);
void register_profile_commands(CLI::App& app);
void register_bisect_command(CLI::App& app);

// --model DIR | --preset NAME [--seed S], shared by the commands that run the model.
struct ModelArgs {
  std::string model;
  std::string preset;
  uint64_t seed = 0;
};
void add_model_options(CLI::App* cmd, ModelArgs& m);
Weights open_model(const ModelArgs& m);
// Under expert parallelism (`experts` not null) each rank loads only its own routed experts
// (model/weights.h only_experts); the model digest is still the whole checkpoint's.
Weights open_model(const ModelArgs& m, const Communicator* experts);
// --tokens LIST|@FILE or --random N (1 <= N <= the config's max_position_embeddings).
std::vector<int32_t> get_tokens(const std::string& spec, int64_t random, uint64_t seed, const ModelConfig& c);

// Bounds of numeric options, applied with CLI11 checks so the error names the flag
// ("--threads: Value 10000 not in range [0 - 1024]", exit 2). Results never depend on the thread count;
// more threads than this only exhausts the machine.
constexpr int kMaxThreads = 1024;
// --threads N with 0 <= N <= kMaxThreads.
CLI::Option* add_threads_option(CLI::App* cmd, int& threads, const std::string& help);
// A finite, non-negative number (CLI11's NonNegativeNumber lets "nan" and "inf" through).
const CLI::Validator& finite_non_negative();

// --ep N: expert parallelism over N ranks (docs/PARALLEL.md), for the commands that run the forward:
// MPI on the CPU; with --device cuda NCCL, its unique id sent over MPI. open_parallel gives the
// process's communicator (nullptr for N = 1; it lives until the process ends) and makes it the active
// one: an error from then on ends every rank (Communicator::abort) instead of leaving them waiting.
struct ParallelArgs {
  int ep = 1;
  bool dp = false;  // --dp: the ranks split the sequences (commands that take it: with_dp)
};
void add_parallel_options(CLI::App* cmd, ParallelArgs& p, bool with_dp = false);
Communicator* open_parallel(const ParallelArgs& p, const std::string& device);
Communicator* active_communicator();  // nullptr when the run is not parallel

// --numerics exact|fast (model/profile.h Numerics; docs/NUMERICS.md "Fast numerics"), for the commands
// that run a forward pass; `numerics` keeps the text (default "exact").
CLI::Option* add_numerics_option(CLI::App* cmd, std::string& numerics);

// The help of every --profile option.
inline constexpr char kProfileHelp[] =
    "Numerics profile: a built-in's name (train, rollout, deepseek-inference, ...; dsv4 profile list) or a "
    "profile file (docs/PROFILES.md)";

// The parsed subcommand's action (set by the callback of whichever subcommand ran); returns the
// process exit code.
void set_action(std::function<int()> action);
int run_selected();

}  // namespace dsv4::cli
