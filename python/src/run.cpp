// forward, replay and diff for Python: each returns the JSON text the CLI prints for the same input
// (`dsv4 forward`, `dsv4 replay --json`, `dsv4 diff --json`), built by the same library functions, so a
// notebook's dict and the CLI's file cannot disagree. The GIL is released while the model runs.
#include <optional>

#include "model/checkpoint.h"
#include "model/collect.h"
#include "model/error.h"
#include "model/forward.h"
#include "model/forward_json.h"
#include "model/profile.h"
#include "python/src/bindings.h"
#include "replay/diff.h"
#include "replay/replay.h"
#include "replay/tolerance.h"

namespace dsv4::python {

void bind_run(py::module_& m) {
  m.def(
      "forward_json",
      [](const std::string& model_dir, const std::string& preset, uint64_t seed, std::vector<int32_t> tokens,
         const std::string& profile, int threads, float temperature) {
        py::gil_scoped_release unlocked;
        if (model_dir.empty() == preset.empty()) throw InputError("give exactly one of model=DIR or preset=NAME");
        const Weights w = model_dir.empty() ? open_preset(preset, seed) : open_checkpoint(model_dir);
        DecisionLog log;
        RunOptions opt;
        opt.profile = load_profile(profile);  // a built-in's name or a profile file
        opt.threads = threads;
        opt.temperature = temperature;
        opt.observer = &log;
        const ForwardResult res = forward(w, {tokens}, opt);
        return forward_to_json(res.seqs[0], log, opt.profile.name);
      },
      py::arg("model_dir"), py::arg("preset"), py::arg("seed"), py::arg("tokens"), py::arg("profile"),
      py::arg("threads"), py::arg("temperature"));

  m.def(
      "replay_json",
      [](const std::string& trace, std::optional<int> step, const std::string& model_dir, int threads,
         bool force_indexer, bool force_routing, const std::string& take_decisions_from, int take_step,
         const std::string& optimizer_state, const std::optional<std::string>& tolerance,
         const std::string& tolerance_logprobs) {
        py::gil_scoped_release unlocked;
        ReplayOptions o;
        if (tolerance) o.tolerance = parse_tolerance(*tolerance, tolerance_logprobs);
        o.step = step;
        o.model_dir = model_dir;
        o.threads = threads;
        o.force_indexer = force_indexer;
        o.force_routing = force_routing;
        o.take_decisions_from = take_decisions_from;
        o.take_step = take_step;
        o.optimizer_state = optimizer_state;
        return replay_to_json(replay_trace(trace, o));
      },
      py::arg("trace"), py::arg("step"), py::arg("model_dir"), py::arg("threads"), py::arg("force_indexer"),
      py::arg("force_routing"), py::arg("take_decisions_from"), py::arg("take_step"), py::arg("optimizer_state"),
      py::arg("tolerance"), py::arg("tolerance_logprobs"));

  m.def(
      "diff_json",
      [](const std::string& a, const std::string& b, int step_a, int step_b, bool allow_model_mismatch,
         double tie_threshold) {
        py::gil_scoped_release unlocked;
        DiffOptions o;
        o.step_a = step_a;
        o.step_b = step_b;
        o.allow_model_mismatch = allow_model_mismatch;
        o.tie_threshold = tie_threshold;
        return diff_to_json(diff_traces(a, b, o));
      },
      py::arg("a"), py::arg("b"), py::arg("step_a"), py::arg("step_b"), py::arg("allow_model_mismatch"),
      py::arg("tie_threshold"));
}

}  // namespace dsv4::python
