// The trace format's dictionary (traces/FORMAT.md): the root's identity and version, and every
// group, dataset and attribute name. The writer, the reader, validation, salvage and replay spell
// names only through here, so they cannot drift apart; a rename here is a format change (bump
// kTraceFormatVersion and document it).
#pragma once

#include <fmt/format.h>

#include <string>

namespace dsv4 {

namespace h5 {
struct Object;
}

// Bump when a name, a shape or an encoding below changes meaning; see traces/FORMAT.md "Versioning".
// Version 4 added external steps (the `engine` attribute; capture/external.h).
// Version 2 added generation steps (kind "generate", the `generation` groups), version 3 training steps
// (kind "train-step", the `training` group). A trace is written as the version its steps' kinds need
// (step_format_version), so a trace of prefill steps only is still version 1 and one with generation
// steps but no training step version 2: earlier readers keep reading every trace they could read.
constexpr int kTraceFormatVersion = 4;  // the newest this build writes and reads
constexpr int kExternalFormatVersion = 4;
constexpr int kTrainingFormatVersion = 3;
constexpr int kGenerationFormatVersion = 2;
constexpr int kPrefillFormatVersion = 1;

namespace trace_layout {

// ---- the root ---------------------------------------------------------------------------------
inline constexpr char kFormatValue[] = "dsv4-trace";  // the value of the root's `format`
inline constexpr char kFormat[] = "format";
inline constexpr char kFormatVersion[] = "format_version";
inline constexpr char kProducer[] = "producer";
inline constexpr char kCreated[] = "created";
inline constexpr char kSalvagedFrom[] = "salvaged_from";

// ---- /meta ------------------------------------------------------------------------------------
inline constexpr char kMeta[] = "meta";
inline constexpr char kEnv[] = "env";
inline constexpr char kModel[] = "model";
inline constexpr char kMetaEnv[] = "meta/env";
inline constexpr char kMetaModel[] = "meta/model";
inline constexpr char kConfigJson[] = "config_json";
inline constexpr char kWeightsPath[] = "weights_path";
inline constexpr char kWeightsPathRecorded[] = "weights_path_recorded";  // set by bundles
inline constexpr char kModelDigest[] = "model_digest";
inline constexpr char kTensorNames[] = "tensor_names";
inline constexpr char kTensorDigests[] = "tensor_digests";
// A joined trace (capture/joined.h): the traces its steps' sequences live in, one per rank, as file
// names relative to the joined trace's folder.
inline constexpr char kMetaParts[] = "meta/parts";
inline constexpr char kParts[] = "parts";

// ---- /steps/NNNNNN ----------------------------------------------------------------------------
inline constexpr char kSteps[] = "steps";
inline constexpr char kKind[] = "kind";
inline constexpr char kProfile[] = "profile";                // the profile's name
inline constexpr char kProfileText[] = "profile_text";       // its canonical text (docs/PROFILES.md)
inline constexpr char kProfileDigest[] = "profile_digest";   // XXH3-64 of the text, 16 hex digits
inline constexpr char kCapture[] = "capture";
inline constexpr char kSeed[] = "seed";
inline constexpr char kThreads[] = "threads";
inline constexpr char kNSeqs[] = "n_seqs";
inline constexpr char kSeqLengths[] = "seq_lengths";
inline constexpr char kStatus[] = "status";

// ---- a sequence: seq_SSS ----------------------------------------------------------------------
inline constexpr char kTokens[] = "tokens";
inline constexpr char kLogprobs[] = "logprobs";
inline constexpr char kDecisions[] = "decisions";
inline constexpr char kDigests[] = "digests";
inline constexpr char kTensors[] = "tensors";
inline constexpr char kKernels[] = "kernels";

// decisions/layer_LLL
inline constexpr char kIndexerCount[] = "indexer_count";
inline constexpr char kIndexerGaps[] = "indexer_gaps";
inline constexpr char kIndexerMargin[] = "indexer_margin";
inline constexpr char kIndexerWidth[] = "indexer_width";  // attribute
inline constexpr char kExperts[] = "experts";
inline constexpr char kExpertWeights[] = "expert_weights";
inline constexpr char kRouterMargin[] = "router_margin";
inline constexpr char kHashed[] = "hashed";  // attribute

// digests
inline constexpr char kDigestTensor[] = "tensor";
inline constexpr char kDigestLayer[] = "layer";
inline constexpr char kDigestRows[] = "rows";
inline constexpr char kDigestValue[] = "value";

// tensors/<name>/layer_LLL
inline constexpr char kDtype[] = "dtype";  // attribute

// kernels
inline constexpr char kAvailable[] = "available";  // attribute
inline constexpr char kReason[] = "reason";        // attribute
inline constexpr char kKernelName[] = "name";

// prefixes of numbered groups
inline constexpr char kSeqPrefix[] = "seq_";
inline constexpr char kLayerPrefix[] = "layer_";
inline constexpr char kGrid[] = "grid";
inline constexpr char kBlock[] = "block";
inline constexpr char kSharedBytes[] = "shared_bytes";
inline constexpr char kRegisters[] = "registers";
inline constexpr char kStream[] = "stream";
inline constexpr char kStartNs[] = "start_ns";
inline constexpr char kEndNs[] = "end_ns";
inline constexpr char kCorrelation[] = "correlation";

// Generation steps (kind "generate", format version 2; capture/generation.h).
inline constexpr char kKindGenerate[] = "generate";
inline constexpr char kGeneration[] = "generation";  // group in the step and in each seq_SSS
inline constexpr char kGenMaxBatch[] = "max_batch";
inline constexpr char kGenPageSize[] = "page_size";
inline constexpr char kGenPrefillChunk[] = "prefill_chunk";
inline constexpr char kGenTokenBudget[] = "token_budget";
inline constexpr char kGenPrefixSharing[] = "prefix_sharing";
inline constexpr char kGenDecodeAttention[] = "decode_attention";
inline constexpr char kGenScheduleStep[] = "schedule_step";
inline constexpr char kGenScheduleRequest[] = "schedule_request";
inline constexpr char kGenSchedulePos0[] = "schedule_pos0";
inline constexpr char kGenScheduleLength[] = "schedule_length";
inline constexpr char kGenScheduleSampled[] = "schedule_sampled";
inline constexpr char kGenId[] = "id";
inline constexpr char kGenRequestKey[] = "request_key";
inline constexpr char kGenPromptLength[] = "prompt_length";
inline constexpr char kGenMaxNewTokens[] = "max_new_tokens";
inline constexpr char kGenTemperature[] = "temperature";
inline constexpr char kGenTopK[] = "top_k";
inline constexpr char kGenTopP[] = "top_p";
inline constexpr char kGenSamplingSeed[] = "sampling_seed";
inline constexpr char kGenFinishReason[] = "finish_reason";
inline constexpr char kGenPrefixSource[] = "prefix_source";
inline constexpr char kGenSharedPrefix[] = "shared_prefix";
inline constexpr char kGenCounters[] = "counters";
inline constexpr char kGenStopIds[] = "stop_ids";

// Training steps (kind "train-step", format version 3; capture/training.h). A ragged list (per sample,
// per parameter) is stored as one concatenated dataset X plus X_count (count_name) holding each
// entry's length; entry i is X[first:first + X_count[i]] with first the sum of the counts before it.
inline constexpr char kKindTrainStep[] = "train-step";
inline constexpr char kTraining[] = "training";  // group in the step
inline constexpr char kTrainSettingsJson[] = "settings_json";
inline constexpr char kTrainOptimizerStepBefore[] = "optimizer_step_before";
inline constexpr char kTrainOptimizerStatePath[] = "optimizer_state_path";
inline constexpr char kTrainOptimizerStateDigest[] = "optimizer_state_digest";
inline constexpr char kTrainMetricNames[] = "metric_names";
inline constexpr char kTrainMetricValues[] = "metric_values";
inline constexpr char kTrainSamples[] = "samples";  // group: one entry per sequence of the step
inline constexpr char kTrainSampleId[] = "id";
inline constexpr char kTrainPromptLength[] = "prompt_length";
inline constexpr char kTrainAdvantage[] = "advantage";
inline constexpr char kTrainReward[] = "reward";
inline constexpr char kTrainHasReward[] = "has_reward";
inline constexpr char kTrainGroup[] = "group";
inline constexpr char kTrainRolloutLogprobs[] = "rollout_logprobs";
inline constexpr char kTrainOldLogprobs[] = "old_logprobs";
inline constexpr char kTrainRefLogprobs[] = "ref_logprobs";
inline constexpr char kTrainParams[] = "params";  // group: one entry per weight tensor
inline constexpr char kTrainParamName[] = "name";
inline constexpr char kTrainParamRows[] = "rows";
inline constexpr char kTrainParamRowElems[] = "row_elems";
inline constexpr char kTrainGrad[] = "grad";
inline constexpr char kTrainWeight[] = "weight";
inline constexpr char kTrainMaster[] = "master";
inline constexpr char kTrainM[] = "m";
inline constexpr char kTrainV[] = "v";
inline constexpr char kTrainActGrads[] = "act_grads";  // group: one entry per activation gradient
inline constexpr char kTrainActSeq[] = "seq";
inline constexpr char kTrainActLayer[] = "layer";
inline constexpr char kTrainActName[] = "name";
inline constexpr char kTrainActRows[] = "rows";
inline constexpr char kTrainActCols[] = "cols";
inline constexpr char kTrainActDigests[] = "digests";
inline constexpr char kTrainFullGrads[] = "full_grads";      // group: a dataset per tensor name
inline constexpr char kTrainFullWeights[] = "full_weights";  // group: a dataset per tensor name
inline constexpr char kCountSuffix[] = "_count";

// External steps (format version 4; capture/external.h): computed by another engine, no digests.
inline constexpr char kEngine[] = "engine";  // step attribute: who computed the step
inline constexpr char kSource[] = "source";  // step attribute: where its data came from
inline constexpr char kExternalCapture[] = "external";  // the step's `capture` attribute
inline constexpr char kRequestId[] = "request_id";     // sequence attribute
inline constexpr char kPromptLength[] = "prompt_length";  // sequence attribute (-1: unknown)
inline constexpr char kUnknownDigest[] = "unknown";       // model_digest when the weights are unknown

// ---- composed names ---------------------------------------------------------------------------
inline std::string step_name(int step) {  // under /steps
  return fmt::format("{:06}", step);
}
inline std::string seq_name(int seq) {  // under a step
  return fmt::format("{}{:03}", kSeqPrefix, seq);
}
inline std::string layer_name(int layer) {  // decisions, tensors
  return layer < 0 ? std::string(kModel) : fmt::format("{}{:03}", kLayerPrefix, layer);
}
inline std::string step_path(int step) {  // "/steps/000012"
  return fmt::format("/{}/{}", kSteps, step_name(step));
}
inline std::string decisions_path(int layer) {  // relative to a sequence
  return fmt::format("{}/{}", kDecisions, layer_name(layer));
}
inline std::string tensor_path(const std::string& name, int layer) {  // relative to a sequence
  return fmt::format("{}/{}/{}", kTensors, name, layer_name(layer));
}
// mHC datasets of a decisions group: mhc_<sublayer>_<part>, part "pre", "post" or "comb".
inline std::string mhc_name(const std::string& sublayer) {
  return "mhc_" + sublayer;
}
inline std::string mhc_name(const std::string& sublayer, const char* part) {
  return fmt::format("mhc_{}_{}", sublayer, part);
}

// The lengths of the entries of the ragged dataset `data` (its X_count companion).
inline std::string count_name(const char* data) {
  return std::string(data) + kCountSuffix;
}

// Step kinds: "train" and "rollout" (prefill steps), kKindGenerate, kKindTrainStep.
bool is_step_kind(const std::string& kind);
std::string step_kinds_text();  // "'train', 'rollout', 'generate' or 'train-step'", for messages
// The format version a trace needs to hold a step of `kind` (kPrefillFormatVersion for prefill steps).
int step_format_version(const std::string& kind);

// Checks the root's identity and version: NotATrace without format = "dsv4-trace",
// UnsupportedTraceVersion when newer than this build reads (naming the producer), TraceError without
// a version. Returns the version (a version below 1 is left to the caller: the reader refuses it,
// validation reports it); `producer` receives the root's producer when given.
int check_trace_root(const h5::Object& root, const std::string& path, std::string* producer = nullptr);

}  // namespace trace_layout
}  // namespace dsv4
