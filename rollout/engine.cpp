#include "rollout/engine.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>

#include "model/error.h"
#include "model/forward.h"
#include "model/threads.h"
#include "rollout/kv_cache.h"

namespace dsv4::rollout {

const char* to_string(FinishReason r) {
  return r == FinishReason::stop ? "stop" : "length";
}

uint64_t request_key(const std::string& id) {
  return XXH3_64bits(id.data(), id.size());
}

namespace {

// A request in flight.
struct Live {
  Request req;
  uint64_t key = 0;
  std::unique_ptr<RequestCache> cache;
  int64_t prefilled = 0;            // prompt tokens in the cache
  std::vector<float> ready_logits;  // logits to sample from before the next chunk (a forked full prompt)
  Generation gen;
};

// A request's cache at the end of its prompt, kept for later requests whose prompt starts with it.
struct Snapshot {
  int owner = 0;
  std::vector<int32_t> prompt;
  std::unique_ptr<RequestCache> cache;
  std::vector<float> last_logits;
};

bool starts_with(const std::vector<int32_t>& a, const std::vector<int32_t>& prefix) {
  return prefix.size() <= a.size() && std::equal(prefix.begin(), prefix.end(), a.begin());
}

}  // namespace

struct Engine::Impl {
  const Weights& w;
  EngineOptions opt;
  std::unique_ptr<backend::Backend> be;
  std::unique_ptr<CacheStore> store;
  std::deque<Live> waiting;
  std::vector<Live> running;
  std::vector<Snapshot> snapshots;
  std::vector<Generation> done;
  int submitted = 0;

  Impl(const Weights& weights, EngineOptions o) : w(weights), opt(std::move(o)) {
    if (opt.max_batch < 1)
      throw InputError(fmt::format("max batch must be at least 1, got {}", opt.max_batch));
    if (opt.page_size < 1)
      throw InputError(fmt::format("page size must be at least 1 row, got {}", opt.page_size));
    if (opt.prefill_chunk < 0)
      throw InputError(
          fmt::format("prefill chunk must be 0 (whole prompt) or positive, got {}", opt.prefill_chunk));
    if (opt.token_budget < 0)
      throw InputError(
          fmt::format("token budget must be 0 (no limit) or positive, got {}", opt.token_budget));
    require_profile_runs_on(opt.profile, opt.device, "generate");
    be = backend::make_backend(opt.device, w);
    store = std::make_unique<CacheStore>(*be, w.config(), opt.profile, opt.page_size);
  }

  ~Impl() {
    // Caches hold backend memory: release them before the backend.
    running.clear();
    waiting.clear();
    snapshots.clear();
    store.reset();
  }

  void sample_into(Live& l, const std::vector<float>& logits) {
    const int64_t pos = int64_t(l.req.prompt.size() + l.gen.tokens.size());
    const SampleResult s = sample_token(logits.data(), int64_t(logits.size()), l.req.sampling, l.key, pos);
    l.gen.tokens.push_back(s.token);
    l.gen.logprobs.push_back(s.logprob);
    l.gen.counters.push_back({s.counter[0], s.counter[1], s.counter[2], s.counter[3]});
    if (std::find(l.req.stop_ids.begin(), l.req.stop_ids.end(), s.token) != l.req.stop_ids.end())
      l.gen.finish = FinishReason::stop;
  }

  bool finished(const Live& l) const {
    return l.gen.finish == FinishReason::stop || int(l.gen.tokens.size()) >= l.req.max_new_tokens;
  }
  // The last generated token is still to be fed (EngineOptions::feed_last_token).
  bool last_token_pending(const Live& l) const {
    return opt.feed_last_token && !l.gen.tokens.empty() &&
           l.cache->length() < int64_t(l.req.prompt.size() + l.gen.tokens.size());
  }

  // A waiting request whose prompt starts with the prompt of a running request still in prefill waits
  // for that prompt's snapshot.
  bool should_wait(const Live& l) const {
    if (!opt.prefix_sharing) return false;
    for (const Live& r : running)
      if (r.prefilled < int64_t(r.req.prompt.size()) && starts_with(l.req.prompt, r.req.prompt)) return true;
    return false;
  }

  void admit() {
    while (!waiting.empty() && int(running.size()) < opt.max_batch && !should_wait(waiting.front())) {
      Live l = std::move(waiting.front());
      waiting.pop_front();
      const Snapshot* best = nullptr;
      if (opt.prefix_sharing)
        for (const Snapshot& s : snapshots)
          if (starts_with(l.req.prompt, s.prompt) && (!best || s.prompt.size() > best->prompt.size()))
            best = &s;
      if (best) {
        l.cache = best->cache->fork();
        l.prefilled = int64_t(best->prompt.size());
        l.gen.prefix_source = best->owner;
        l.gen.shared_prefix = l.prefilled;
        if (l.prefilled == int64_t(l.req.prompt.size())) l.ready_logits = best->last_logits;
      } else {
        l.cache = std::make_unique<RequestCache>(*store);
      }
      running.push_back(std::move(l));
    }
  }

  std::vector<Generation> run(const std::function<void(const StepInfo&)>& progress) {
    const auto t0 = std::chrono::steady_clock::now();
    const OmpThreadScope threads(opt.threads);

    RunOptions ro;
    ro.profile = opt.profile;
    ro.observer = opt.observer;
    int64_t generated = 0;
    for (int64_t step = 0; !waiting.empty() || !running.empty(); ++step) {
      admit();
      if (running.empty()) throw Error("rollout engine: no request can be admitted");
      StepInfo info;
      info.step = step;
      // Forked full prompts sample at once; then decodes (one token each), then prefill chunks, within
      // the token budget.
      int64_t budget = opt.token_budget > 0 ? opt.token_budget : INT64_MAX;
      std::vector<std::pair<size_t, int64_t>> plan;  // (running index, tokens)
      for (size_t i = 0; i < running.size(); ++i) {
        Live& l = running[i];
        if (!l.ready_logits.empty()) {
          sample_into(l, l.ready_logits);
          l.ready_logits.clear();
          ++generated;
          info.chunks.push_back({l.gen.index, l.prefilled, 0, true});
        }
      }
      for (size_t i = 0; i < running.size() && budget > 0; ++i) {
        Live& l = running[i];
        if (l.prefilled == int64_t(l.req.prompt.size()) && !l.gen.tokens.empty() &&
            (!finished(l) || last_token_pending(l))) {
          plan.push_back({i, 1});
          --budget;
        }
      }
      for (size_t i = 0; i < running.size() && budget > 0; ++i) {
        Live& l = running[i];
        const int64_t left = int64_t(l.req.prompt.size()) - l.prefilled;
        if (left <= 0) continue;
        int64_t n = std::min(left, budget);
        if (opt.prefill_chunk > 0) n = std::min<int64_t>(n, opt.prefill_chunk);
        plan.push_back({i, n});
        budget -= n;
      }
      std::stable_sort(plan.begin(), plan.end(),
                       [](const auto& a, const auto& b) { return a.first < b.first; });

      for (const auto& [i, n] : plan) {
        Live& l = running[i];
        const int64_t pos0 = l.cache->length();
        std::vector<int32_t> chunk;
        if (l.prefilled < int64_t(l.req.prompt.size()))
          chunk.assign(l.req.prompt.begin() + l.prefilled, l.req.prompt.begin() + l.prefilled + n);
        else
          chunk.push_back(l.gen.tokens.back());
        SequenceResult r = forward_chunk(*be, w, l.gen.index, chunk, *l.cache, ro);
        l.gen.peak_cache_bytes = std::max(l.gen.peak_cache_bytes, l.cache->bytes());
        bool sampled = false;
        if (l.prefilled < int64_t(l.req.prompt.size())) {
          l.prefilled += n;
          if (l.prefilled == int64_t(l.req.prompt.size())) {
            if (opt.prefix_sharing && !waiting.empty())
              snapshots.push_back(Snapshot{l.gen.index, l.req.prompt, l.cache->fork(), r.last_logits});
            sample_into(l, r.last_logits);
            sampled = true;
          }
        } else if (!finished(l)) {  // a finished request fed its last token only to report its rows
          sample_into(l, r.last_logits);
          sampled = true;
        }
        if (sampled) ++generated;
        info.chunks.push_back({l.gen.index, pos0, n, sampled});
      }

      // Retire finished requests (their pages go back to the pools).
      for (size_t i = 0; i < running.size();) {
        if (finished(running[i]) && running[i].ready_logits.empty() && !last_token_pending(running[i])) {
          running[i].cache.reset();
          done.push_back(std::move(running[i].gen));
          running.erase(running.begin() + std::ptrdiff_t(i));
        } else {
          ++i;
        }
      }
      if (waiting.empty()) snapshots.clear();
      be->synchronize();
      info.finished = int(done.size());
      info.total = submitted;
      info.generated = generated;
      info.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (progress) progress(info);
    }
    std::vector<Generation> out = std::move(done);
    done.clear();
    std::sort(out.begin(), out.end(),
              [](const Generation& a, const Generation& b) { return a.index < b.index; });
    return out;
  }
};

Engine::Engine(const Weights& w, EngineOptions opt) : impl_(std::make_unique<Impl>(w, std::move(opt))) {}
Engine::~Engine() = default;

int Engine::submit(Request r) {
  const ModelConfig& c = impl_->w.config();
  const std::string where = fmt::format("request '{}'", r.id);
  if (r.prompt.empty()) throw InputError(fmt::format("{}: the prompt is empty", where));
  for (size_t t = 0; t < r.prompt.size(); ++t)
    if (r.prompt[t] < 0 || r.prompt[t] >= c.vocab_size)
      throw InputError(fmt::format("{}: prompt[{}] = {} is outside the vocabulary [0, {})", where, t,
                                   r.prompt[t], c.vocab_size));
  if (r.max_new_tokens < 1)
    throw InputError(fmt::format("{}: max_new_tokens must be at least 1, got {}", where, r.max_new_tokens));
  if (int64_t(r.prompt.size()) + r.max_new_tokens > c.max_position_embeddings)
    throw InputError(
        fmt::format("{}: prompt length {} + max_new_tokens {} exceeds max_position_embeddings = {}", where,
                    r.prompt.size(), r.max_new_tokens, c.max_position_embeddings));
  for (int32_t s : r.stop_ids)
    if (s < 0 || s >= c.vocab_size)
      throw InputError(
          fmt::format("{}: stop id {} is outside the vocabulary [0, {})", where, s, c.vocab_size));
  check_sampling(r.sampling, where);
  Live l;
  l.key = request_key(r.id);
  l.gen.id = r.id;
  l.gen.index = impl_->submitted++;
  l.gen.prompt = r.prompt;
  l.req = std::move(r);
  const int index = l.gen.index;
  impl_->waiting.push_back(std::move(l));
  return index;
}

std::vector<Generation> Engine::run(const std::function<void(const StepInfo&)>& progress) {
  return impl_->run(progress);
}

int64_t Engine::cache_bytes() const {
  return impl_->store->bytes_in_use();
}

}  // namespace dsv4::rollout
