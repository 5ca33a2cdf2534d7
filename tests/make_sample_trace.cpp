// Writes a small trace of the tiny preset (seed 7) for tests that read traces with other tools:
//   make_sample_trace OUT.h5                two complete steps (train, rollout profiles), sequences of
//                                           1, 9 and 70 tokens, capture "attn.q@1,indexer.*,logits"
//   make_sample_trace OUT.h5 --die-in-step  one complete step, then SIGKILL in the middle of the
//                                           second (what a crashed recorder leaves)
#include <csignal>
#include <cstdio>
#include <cstring>
#include <exception>

#include "capture/trace_writer.h"
#include "model/forward.h"
#include "model/tokens.h"
#include "model/weights.h"

int main(int argc, char** argv) {
  using namespace dsv4;
  if (argc < 2 || (argc == 3 && std::strcmp(argv[2], "--die-in-step") != 0) || argc > 3) {
    std::fprintf(stderr, "usage: %s OUT.h5 [--die-in-step]\n", argv[0]);
    return 2;
  }
  const bool die = argc == 3;
  try {
    const Weights w = Weights::init(preset("tiny"), 7);
    TraceWriter::Options opt;
    opt.policy = CapturePolicy::parse("attn.q@1,indexer.*,logits");
    auto writer = TraceWriter::create(argv[1], w.config(), make_trace_header(w), opt);
    const int vocab = w.config().vocab_size;
    const std::vector<std::vector<int32_t>> seqs = {random_tokens(1, vocab, 1), random_tokens(9, vocab, 2),
                                                    random_tokens(70, vocab, 3)};
    for (int step = 0; step < 2; ++step) {
      StepSpec s;
      s.kind = step == 0 ? "train" : "rollout";
      s.profile = step == 0 ? "train" : "rollout";
      s.seed = uint64_t(step);
      s.threads = 1;
      s.seqs = seqs;
      RunOptions o;
      o.profile = step == 0 ? profile_train() : profile_rollout();
      o.threads = 1;
      o.observer = &writer->begin_step(s);
      const ForwardResult r = forward(w, seqs, o);
      if (die && step == 1) std::raise(SIGKILL);
      writer->end_step(r);
    }
    writer->close();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "make_sample_trace: %s\n", e.what());
    return 1;
  }
  return 0;
}
