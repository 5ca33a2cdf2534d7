// Diff of two training steps (traces/FORMAT.md "Training steps"; docs/DIFF_JSON.md "training"): how
// the gradients of step B differ from those of step A (e.g. a step with routing replay against one
// without), per parameter and aggregated per (parameter kind, layer) and per layer, plus the step's
// metrics and settings side by side. A is the reference: every ratio is B against A.
//
// Numbers over full gradients (both records hold the parameter in full_grads; `--capture-params`):
//     rel_l2 = ||gB − gA|| / ||gA||,  cosine = <gA, gB> / (||gA|| ||gB||),  max_abs = max |gB − gA|
// in fp64, every sum over the elements in index order (for an aggregate: over its parameters in name
// order, then the elements). rel_l2 is 0 when the gradients are equal, +inf when ||gA|| = 0 < ||gB − gA||;
// cosine is exactly 1 when they are equal (also when both are 0), NaN (undefined) when exactly one norm
// is 0, else clamped to [−1, 1]. Element pairs that differ with a NaN or Inf on either side are counted
// in nonfinite_differing and left out of every sum.
//
// Without full gradients the per-row digests still say how many rows differ; when none does the
// gradients are equal (rel_l2 0, cosine 1), otherwise the numbers are NaN (unknown).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/weights.h"

namespace dsv4 {

struct TrainingRecord;  // capture/training.h


// One parameter present in both records.
struct ParamGradDiff {
  std::string name;
  ParamSite site;
  int64_t rows = 0, row_elems = 0;
  bool grad_a = false, grad_b = false;  // the step trained it (its gradient digests are there)
  bool full = false;                    // both records hold the full gradient
  // Gradient digest rows that differ (both trained); every row when only one side trained it.
  int64_t rows_differing = 0;
  int64_t weight_rows_differing = 0;  // rows of the updated compute weights whose digests differ
  // Over the full gradients, or from the digests as said above; NaN when unknown.
  double rel_l2 = 0, cosine = 1, max_abs = 0;
  double norm_a = 0, norm_b = 0;  // ||gA||, ||gB|| (NaN without full gradients)
  int64_t nonfinite_differing = 0;
};

// Parameters grouped by (kind, layer) — every expert of a layer's kind together — or by layer (kind
// "": every parameter of the layer). Only parameters trained in both steps count. The numbers are those
// of the concatenation of the group's gradients (parameters in name order) when both records hold
// every one of them in full; otherwise 0, 1, 0 when no digest row of the group differs, else NaN
// (unknown: full_params < params says why).
struct GradAggregate {
  std::string kind;  // "" for a per-layer aggregate
  int layer = -1;
  int params = 0;       // parameters of the group trained in both steps
  int full_params = 0;  // of which both records hold the full gradient
  int params_differing = 0;
  int64_t rows = 0, rows_differing = 0;  // gradient digest rows
  double rel_l2 = 0, cosine = 1, max_abs = 0;
  double norm_a = 0, norm_b = 0;
  int64_t nonfinite_differing = 0;
};

struct MetricDiff {
  std::string name;
  double a = 0, b = 0;  // NaN where that step does not report the metric
};

// A setting of the steps' settings JSON whose values differ ("adamw.lr": "1e-05" vs "0.001"); a key
// is the path of a leaf in the document, its values the leaf as JSON text ("(absent)" when missing).
struct SettingDiff {
  std::string key, a, b;
};

struct TrainingDiff {
  std::vector<MetricDiff> metrics;                     // the union of both steps' metric names, ascending
  std::vector<SettingDiff> settings;                   // differing settings, in key order
  int64_t optimizer_step_a = 0, optimizer_step_b = 0;  // AdamW steps taken before each step
  std::vector<ParamGradDiff> params;                   // every parameter of both records, in name order
  std::vector<std::string> kinds;     // the rows of `cells`: layer kinds ascending, then model-level
  std::vector<GradAggregate> cells;   // per (kind, layer) that has a parameter trained in both
  std::vector<GradAggregate> layers;  // per layer with such a parameter, −1 (model-level) first
  int params_trained = 0;             // trained in both steps
  int params_full = 0;                // of which both hold the full gradient
  int params_differing = 0;           // of which some gradient row differs
  // Samples whose loss inputs differ (id, advantage, reward, group, rollout/old/ref log-probs),
  // parameters in one record only or of different shapes, a gradient in one step only.
  std::vector<std::string> notes;

  const GradAggregate* cell(const std::string& kind, int layer) const;  // nullptr when absent
};

// Throws InputError when the records hold different samples (count or a prompt length: the message
// names the sample); everything else that differs becomes a note.
TrainingDiff training_gradient_diff(const TrainingRecord& a, const TrainingRecord& b);

}  // namespace dsv4
