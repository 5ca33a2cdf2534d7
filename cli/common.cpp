#include <fmt/core.h>

#include <cmath>
#include <functional>
#include <stdexcept>

#include "capture/version.h"
#include "cli/commands.h"
#include "model/checkpoint.h"
#include "model/device.h"
#include "model/error.h"
#include "model/tokens.h"
#ifdef DSV4_HAVE_MPI
#include "parallel/mpi_communicator.h"
#endif
#ifdef DSV4_HAVE_NCCL
#include "parallel/nccl_communicator.h"
#endif

namespace dsv4::cli {

namespace {
std::function<int()>& action() {
  static std::function<int()> a;
  return a;
}
std::unique_ptr<Communicator>& active() {
  static std::unique_ptr<Communicator> c;
  return c;
}
#ifdef DSV4_HAVE_NCCL
std::unique_ptr<Communicator>& bootstrap() {  // the MPI world under a NCCL communicator
  static std::unique_ptr<Communicator> c;
  return c;
}
#endif
}  // namespace

void add_parallel_options(CLI::App* cmd, ParallelArgs& p, bool with_dp) {
  cmd->add_option("--ep", p.ep,
                  "Expert parallelism over N processes: run under `mpirun -np N` (the routed experts shared "
                  "out; the same bits for every N; MPI on the CPU, NCCL with --device cuda)")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));
  if (with_dp)
    cmd->add_flag("--dp", p.dp,
                  "With --ep N: the ranks split the sequences (each runs its own, the tokens travel to their "
                  "experts' owners and back; the same bits per sequence); CPU only");
}

CLI::Option* add_numerics_option(CLI::App* cmd, std::string& numerics) {
  return cmd
      ->add_option(
          "--numerics", numerics,
          "exact: the CPU's bits on every device; fast: GEMMs, experts, indexer and attention on bf16 "
          "tensor cores (--device cuda only; bitwise on one GPU architecture with one revision of the "
          "kernels; the profile becomes NAME.fast)")
      ->check(CLI::IsMember({"exact", "fast"}))
      ->capture_default_str();
}

Communicator* open_parallel(const ParallelArgs& p, const std::string& device) {
  if (p.dp && p.ep <= 1)
    throw InputError("--dp splits the sequences among the --ep ranks: give --ep N with N > 1 (under mpirun -np N)");
  if (p.dp && parse_device(device) != Device::cpu)
    throw InputError(fmt::format("--dp runs on the CPU only (MPI); with --device {} every rank runs every sequence: "
                                 "leave out --dp",
                                 device));
  if (p.ep <= 1) return nullptr;
#ifdef DSV4_HAVE_MPI
  if (parse_device(device) == Device::cpu) {
    active() = mpi_world(p.ep);
    return active().get();
  }
#ifdef DSV4_HAVE_NCCL
  bootstrap() = mpi_world(p.ep);
  try {
    active() = nccl_world(bootstrap().get());
  } catch (const std::exception& e) {
    bootstrap()->abort(e.what(), 2);  // every rank ends: the others may be waiting for this one
  }
  return active().get();
#else
  throw InputError(fmt::format("--ep {} --device {}: this dsv4 was built without NCCL (a CUDA build finds it in "
                               "the CUDA toolkit or the system)",
                               p.ep, device));
#endif
#else
  (void)device;
  throw InputError(fmt::format("--ep {}: this dsv4 was built without MPI (install libopenmpi-dev and rebuild)", p.ep));
#endif
}

Communicator* active_communicator() {
  return active().get();
}

std::string version_string() {
  return fmt::format("dsv4 {}", version());
}

void add_model_options(CLI::App* cmd, ModelArgs& m) {
  cmd->add_option("--model", m.model, "Checkpoint directory (config.json + safetensors)");
  cmd->add_option("--preset", m.preset, "Built-in config with seeded weights: tiny, tiny-b, mid");
  cmd->add_option("--seed", m.seed, "Seed of the preset's weights")->capture_default_str()->check(CLI::NonNegativeNumber);
}

Weights open_model(const ModelArgs& m) {
  return open_model(m, nullptr);
}

Weights open_model(const ModelArgs& m, const Communicator* experts) {
  if (m.model.empty() == m.preset.empty())
    throw InputError("give exactly one of --model DIR or --preset NAME");
  const auto own = [experts](const ModelConfig& c) {
    return rank_experts(c.n_routed_experts, experts->rank(), experts->size());
  };
  if (!m.model.empty())
    return experts ? open_checkpoint(m.model, own(checkpoint_config(m.model))) : open_checkpoint(m.model);
  Weights w = open_preset(m.preset, m.seed);
  if (experts) w.keep_only(own(w.config()));
  return w;
}

std::vector<int32_t> get_tokens(const std::string& spec, int64_t random, uint64_t seed, const ModelConfig& c) {
  if (random < 0) throw InputError(fmt::format("--random: {} is negative (give a token count >= 1)", random));
  if (random > c.max_position_embeddings)
    throw InputError(fmt::format("--random: {} tokens exceed the model's max_position_embeddings ({})", random,
                                 c.max_position_embeddings));
  if (spec.empty() == (random <= 0))
    throw InputError("give exactly one of --tokens LIST|@FILE or --random N");
  return spec.empty() ? random_tokens(random, c.vocab_size, seed) : parse_tokens(spec);
}

CLI::Option* add_threads_option(CLI::App* cmd, int& threads, const std::string& help) {
  return cmd->add_option("--threads", threads, help)->capture_default_str()->check(CLI::Range(0, kMaxThreads));
}

const CLI::Validator& finite_non_negative() {
  static const CLI::Validator v(
      [](std::string& s) -> std::string {
        double x = 0;
        if (!CLI::detail::lexical_cast(s, x)) return "'" + s + "' is not a number";
        if (!std::isfinite(x) || x < 0) return "'" + s + "' must be a finite number >= 0";
        return "";
      },
      "NUMBER >= 0");
  return v;
}

void set_action(std::function<int()> a) {
  action() = std::move(a);
}

int run_selected() {
  if (!action()) throw std::logic_error("no command selected");
  return action()();
}

}  // namespace dsv4::cli
