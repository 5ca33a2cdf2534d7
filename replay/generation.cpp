#include "replay/generation.h"

#include <fmt/format.h>

#include <chrono>

#include "capture/layout.h"
#include "model/error.h"

namespace dsv4 {

CollectedGeneration run_collected(const Weights& w, const std::vector<rollout::Request>& requests,
                                  rollout::EngineOptions opt,
                                  std::function<bool(std::string_view, int)> keep_values,
                                  const std::function<void(const rollout::StepInfo&)>& progress) {
  CollectedGeneration c;
  c.collector = std::make_unique<GenerationCollector>(w.config(), std::move(keep_values));
  for (const auto& r : requests)
    c.collector->add_request(r.prompt, r.sampling.temperature > 0 ? r.sampling.temperature : 1.0f);
  opt.observer = c.collector.get();
  opt.feed_last_token = true;
  rollout::Engine engine(w, opt);
  for (const auto& r : requests) engine.submit(r);
  const auto t0 = std::chrono::steady_clock::now();
  c.gens = engine.run([&](const rollout::StepInfo& s) {
    for (const auto& ch : s.chunks)
      c.record.schedule.push_back(
          GenerationChunk{int32_t(s.step), int32_t(ch.request), ch.pos0, ch.n, uint8_t(ch.sampled ? 1 : 0)});
    if (progress) progress(s);
  });
  c.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  GenerationRecord& g = c.record;
  g.max_batch = opt.max_batch;
  g.page_size = opt.page_size;
  g.prefill_chunk = opt.prefill_chunk;
  g.token_budget = opt.token_budget;
  g.prefix_sharing = opt.prefix_sharing;
  g.decode_attention = decode_attention_name(opt.profile);
  for (size_t i = 0; i < c.gens.size(); ++i) {
    const rollout::Generation& gen = c.gens[i];
    const rollout::Request& q = requests[i];
    if (gen.prefix_source >= 0) c.collector->set_prefix(int(i), gen.prefix_source, gen.shared_prefix);
    GenerationRequestRecord r;
    r.id = gen.id;
    r.request_key = rollout::request_key(gen.id);
    r.prompt_length = int64_t(gen.prompt.size());
    r.max_new_tokens = q.max_new_tokens;
    r.stop_ids = q.stop_ids;
    r.temperature = q.sampling.temperature;
    r.top_k = q.sampling.top_k;
    r.top_p = q.sampling.top_p;
    r.sampling_seed = q.sampling.seed;
    r.tokens = gen.tokens;
    r.logprobs = gen.logprobs;
    r.counters = gen.counters;
    r.finish_reason = rollout::to_string(gen.finish);
    r.prefix_source = gen.prefix_source;
    r.shared_prefix = gen.shared_prefix;
    g.requests.push_back(std::move(r));

    std::vector<int32_t> computed = gen.prompt;  // prompt + response: the recorder feeds every token
    computed.insert(computed.end(), gen.tokens.begin(), gen.tokens.end());
    std::vector<float> lp = c.collector->sequence_logprobs(int(i), int64_t(computed.size()), gen.logprobs);
    c.computed.push_back(std::move(computed));
    c.logprobs.push_back(std::move(lp));
  }
  return c;
}

CollectedGeneration record_generation(const Weights& w, const std::vector<rollout::Request>& requests,
                                      const rollout::EngineOptions& opt, const std::string& out,
                                      const GenerateRecordOptions& ro,
                                      const std::function<void(const rollout::StepInfo&)>& progress) {
  TraceWriter::Options wo;
  wo.policy = CapturePolicy::parse(ro.capture);
  const CapturePolicy policy = wo.policy;
  // Open the trace first: a bad path fails before the run, not after it.
  std::unique_ptr<TraceWriter> writer = ro.append
                                            ? TraceWriter::append(out, w.config(), make_trace_header(w), wo)
                                            : TraceWriter::create(out, w.config(), make_trace_header(w), wo);
  CollectedGeneration c = run_collected(
      w, requests, opt,
      [policy](std::string_view name, int layer) { return policy.wants_tensor(name, layer); }, progress);
  StepSpec spec;
  spec.kind = trace_layout::kKindGenerate;
  spec.set_profile(opt.profile);
  spec.seed = ro.seed;
  spec.threads = opt.threads;
  spec.seqs = c.computed;
  Observer& obs = writer->begin_step(spec);
  ForwardResult fr;
  for (size_t i = 0; i < c.gens.size(); ++i) {
    c.collector->report_request(int(i), int64_t(c.computed[i].size()), int(i), c.gens[i].logprobs, obs);
    SequenceResult sr;
    sr.tokens = c.computed[i];
    sr.logprobs = c.logprobs[i];
    fr.seqs.push_back(std::move(sr));
  }
  KernelRecords k;
  k.reason = "not recorded for generation steps";
  writer->set_kernel_records(std::move(k));
  writer->set_generation(c.record);
  writer->end_step(fr);
  writer->close();
  return c;
}

std::vector<rollout::Request> recorded_requests(const GenerationRecord& g,
                                                const std::vector<std::vector<int32_t>>& seq_tokens) {
  std::vector<rollout::Request> out;
  for (size_t i = 0; i < g.requests.size(); ++i) {
    const GenerationRequestRecord& r = g.requests[i];
    if (i >= seq_tokens.size() || r.prompt_length < 1 || r.prompt_length > int64_t(seq_tokens[i].size()))
      throw InputError(
          fmt::format("generation request {} ('{}'): prompt length {} does not fit the {} recorded tokens", i,
                      r.id, r.prompt_length, i < seq_tokens.size() ? seq_tokens[i].size() : 0));
    rollout::Request q;
    q.id = r.id;
    q.prompt.assign(seq_tokens[i].begin(), seq_tokens[i].begin() + r.prompt_length);
    q.max_new_tokens = r.max_new_tokens;
    q.stop_ids = r.stop_ids;
    q.sampling.temperature = r.temperature;
    q.sampling.top_k = r.top_k;
    q.sampling.top_p = r.top_p;
    q.sampling.seed = r.sampling_seed;
    out.push_back(std::move(q));
  }
  return out;
}

rollout::EngineOptions recorded_engine_options(const GenerationRecord& g, const NumericsProfile& profile) {
  rollout::EngineOptions o;
  o.profile = profile;
  o.profile.decode_attention_splits = parse_decode_attention(g.decode_attention);
  o.max_batch = g.max_batch;
  o.page_size = g.page_size;
  o.prefill_chunk = g.prefill_chunk;
  o.token_budget = g.token_budget;
  o.prefix_sharing = g.prefix_sharing;
  return o;
}

std::string schedule_context(const GenerationRecord& g, int request, int64_t pos) {
  if (request < 0 || size_t(request) >= g.requests.size()) return {};
  const int64_t P = g.requests[size_t(request)].prompt_length;
  int decode = 0;
  for (const GenerationChunk& c : g.schedule) {
    if (c.request != request || c.length == 0) continue;
    const bool is_decode = c.pos0 >= P;
    if (pos >= c.pos0 && pos < c.pos0 + c.length)
      return is_decode ? fmt::format("request '{}' position {}: decode step {} (scheduler step {})",
                                     g.requests[size_t(request)].id, pos, decode, c.step)
                       : fmt::format("request '{}' position {}: prefill chunk [{}, {}) (scheduler step {})",
                                     g.requests[size_t(request)].id, pos, c.pos0, c.pos0 + c.length, c.step);
    if (is_decode) ++decode;
  }
  const int src = g.requests[size_t(request)].prefix_source;
  if (src >= 0 && pos < g.requests[size_t(request)].shared_prefix)
    return fmt::format("request '{}' position {}: computed by request {} (shared prompt)",
                       g.requests[size_t(request)].id, pos, src) +
           " — " + schedule_context(g, src, pos);
  return {};
}

}  // namespace dsv4
