// Writes the seed corpora of the harnesses into DIR/<harness>/ (scripts/fuzz.sh): every preset's
// config.json, small safetensors files through the project's writer, capture policies, JSONL files,
// training samples and rewards files, and the small traces of fuzz/fuzz_traces.h (prefill steps of 6
// and 24 tokens, the second with captured tensors, and a generation step), and the first one's decisions
// exported as SGLang JSONL and miles .npz samples.
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "adapters/convert.h"
#include "capture/trace_reader.h"
#include "fuzz_traces.h"
#include "model/config.h"
#include "model/profile.h"
#include "model/safetensors.h"

namespace fs = std::filesystem;

static void put(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
}

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const fs::path dir = argv[1];
  for (const char* h : {"fuzz_trace", "fuzz_config", "fuzz_safetensors", "fuzz_policy", "fuzz_jsonl", "fuzz_samples",
                        "fuzz_import", "fuzz_profile"})
    fs::create_directories(dir / h);
  for (const std::string& name : dsv4::preset_names())
    put(dir / "fuzz_config" / (name + ".json"), dsv4::config_to_json(dsv4::preset(name)));
  for (const std::string& name : dsv4::profile_names())
    put(dir / "fuzz_profile" / (name + ".profile"), dsv4::builtin_profile_source(name));

  dsv4::SafetensorsWriter a;
  a.add_f32("model.norm.weight", {4}, {1, 2, 3, 4});
  a.add_bf16("layers.0.w", {2, 3}, {0.5f, -1, 2, 0, 1, 3});
  a.add_i32("layers.0.tid2eid", {2, 2}, {0, 1, 2, 3});
  a.set_metadata("format", "pt");
  a.write((dir / "fuzz_safetensors" / "small.safetensors").string());
  dsv4::SafetensorsWriter b;
  b.add_f32("x", {1}, {7});
  b.write((dir / "fuzz_safetensors" / "one.safetensors").string());

  int i = 0;
  for (const char* p : {"decisions", "full", "attn.*@3-5,moe.out", "attn.q@1", "logits", "indexer.*@0-5,mhc.*",
                        "decisions,attn.kv@2"})
    put(dir / "fuzz_policy" / ("p" + std::to_string(i++)), p);

  put(dir / "fuzz_jsonl" / "batch.jsonl", "[1,2,3,4,5,6,7,8,9]\n\n{\"tokens\": [9,8,7]}\n");
  put(dir / "fuzz_jsonl" / "prompts.jsonl",
      "{\"id\": \"a\", \"prompt\": [1, 2, 3], \"max_new_tokens\": 4, \"temperature\": 0.7, \"top_p\": 0.9, "
      "\"top_k\": 5, \"seed\": 3, \"stop\": [0]}\n{\"prompt\": [4, 5]}\n");
  const std::string samples =
      "{\"id\": \"s0\", \"prompt\": [1, 2, 3], \"response\": [4, 5], \"rollout_logprobs\": [-1.5, -0.25], "
      "\"reward\": 1.0, \"group\": \"g\"}\n{\"id\": \"s1\", \"prompt\": [1, 2, 3], \"response\": [6], "
      "\"rollout_logprobs\": [-2.0], \"reward\": 0.0, \"group\": \"g\"}\n";
  put(dir / "fuzz_jsonl" / "samples.jsonl", samples);
  put(dir / "fuzz_samples" / "samples.jsonl", samples);
  put(dir / "fuzz_samples" / "advantages.jsonl",
      "{\"id\": 3, \"prompt\": [7], \"response\": [8, 9], \"old_logprobs\": [-1, -2], \"ref_logprobs\": [-1.25, "
      "-2.5], \"advantage\": -0.5}\n\n{\"prompt\": [1], \"response\": [2], \"advantage\": 0.5}\n");
  put(dir / "fuzz_samples" / "generated.jsonl",
      "{\"id\": \"a\", \"index\": 0, \"prompt\": [1, 2], \"response\": [3], \"logprobs\": [-0.5], "
      "\"finish_reason\": \"length\", \"sampling\": {}, \"prefix\": 0, \"reward\": 1}\n");
  put(dir / "fuzz_samples" / "gen-rewards.jsonl",
      "{\"id\": \"a\", \"reward\": 1, \"group\": \"g\"}\n{\"id\": \"b\", \"reward\": 0}\n");
  put(dir / "fuzz_samples" / "seq-advantages.jsonl", "{\"seq\": 0, \"advantage\": 1}\n{\"seq\": 1, \"advantage\": -1}\n");
  put(dir / "fuzz_samples" / "prefill-rewards.jsonl", "{\"seq\": 0, \"reward\": 0.5, \"prompt_length\": 3}\n");
  dsv4::fuzz::write_prefill_trace((dir / "fuzz_trace" / "small.h5").string());
  // Captured tensors and their digests, as in traces/samples/ (which are 96 tokens, 320 kB).
  dsv4::fuzz::write_prefill_trace((dir / "fuzz_trace" / "tensors.h5").string(), "attn.kv@1,moe.out@3", 24);
  dsv4::fuzz::write_prefill_trace((dir / "fuzz_samples" / "prefill.h5").string());
  dsv4::fuzz::write_generation_trace((dir / "fuzz_trace" / "generation.h5").string());
  dsv4::fuzz::write_generation_trace((dir / "fuzz_samples" / "generation.h5").string());
  // The engines' layouts of the small trace's decisions: SGLang JSONL and miles .npz samples.
  {
    const dsv4::TraceReader r = dsv4::TraceReader::open((dir / "fuzz_trace" / "small.h5").string());
    const fs::path jsonl = dir / "fuzz_import" / "small.jsonl";
    fs::remove(jsonl);
    dsv4::export_sglang(r, 0, jsonl.string());
    const fs::path npz = dir / "fuzz_import" / "npz";
    fs::remove_all(npz);
    dsv4::export_miles(r, 0, npz.string());
    for (const auto& e : fs::directory_iterator(npz)) fs::rename(e.path(), dir / "fuzz_import" / e.path().filename());
    fs::remove_all(npz);
  }
  return 0;
}
