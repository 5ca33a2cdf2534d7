// Writes the seed corpora of the harnesses into DIR/<harness>/ (scripts/fuzz.sh): every preset's
// config.json, small safetensors files through the project's writer, capture policies, JSONL files,
// and a small trace of the tiny preset (one step of 6 tokens, decisions only; the script adds
// traces/samples/*.h5, which are larger and slower to run).
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "capture/trace_writer.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/forward.h"
#include "model/safetensors.h"

namespace fs = std::filesystem;

static void put(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
}

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  const fs::path dir = argv[1];
  for (const char* h : {"fuzz_trace", "fuzz_config", "fuzz_safetensors", "fuzz_policy", "fuzz_jsonl"})
    fs::create_directories(dir / h);
  for (const std::string& name : dsv4::preset_names())
    put(dir / "fuzz_config" / (name + ".json"), dsv4::config_to_json(dsv4::preset(name)));

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
  put(dir / "fuzz_jsonl" / "samples.jsonl",
      "{\"id\": \"s0\", \"prompt\": [1, 2, 3], \"response\": [4, 5], \"rollout_logprobs\": [-1.5, -0.25], "
      "\"reward\": 1.0, \"group\": \"g\"}\n{\"id\": \"s1\", \"prompt\": [1, 2, 3], \"response\": [6], "
      "\"rollout_logprobs\": [-2.0], \"reward\": 0.0, \"group\": \"g\"}\n");
  {
    const dsv4::Weights w = dsv4::open_preset("tiny", 7);
    dsv4::TraceWriter::Options opt;
    opt.policy = dsv4::CapturePolicy::parse("decisions");
    auto wr = dsv4::TraceWriter::create((dir / "fuzz_trace" / "small.h5").string(), w.config(),
                                        dsv4::make_trace_header(w), opt);
    dsv4::StepSpec spec;
    spec.seqs = {{5, 17, 2, 99, 4, 31}};
    dsv4::RunOptions ro;
    ro.observer = &wr->begin_step(spec);
    wr->end_step(dsv4::forward(w, spec.seqs, ro));
    wr->close();
  }
  return 0;
}
