// Expert parallelism (docs/PARALLEL.md): the MoE split into per-rank expert ranges and the slot-order
// sum gives moe_experts' bits for every rank count (even and uneven ranges, a rank with no tokens,
// repeated ids); and through the CLI under `mpirun -np 2/4` (Open MPI, oversubscribed on small
// machines): forward with --ep 1/2/4 byte-identical on tiny (8 experts) and tiny-b (6 experts: uneven
// ranges at 4), record with --ep 2 replayed in one process (exit 0, the layout named), the
// mismatched or missing launcher named, and a rank killed mid-run ending the whole job in bounded
// time. The MPI tests skip (exit 77 shown as a skip) where mpirun or MPI support is missing.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "cli_util.h"
#include "kernels/grad.h"
#include "kernels/moe.h"
#include "model/communicator.h"
#include "model/error.h"
#include "model/forward.h"
#include "model/tokens.h"
#include "test_util.h"
#include "thread_ranks.h"
#include "tiny_model.h"
#include "model/collect.h"
#include "model/expert_parallel.h"
#include "paths.h"

namespace dsv4 {
namespace {

using test::bitwise_equal;

// One MoE problem with random weights; ids ascending per token, some tokens with a repeated id.
struct MoeCase {
  int64_t T = 37, D = 24, I = 16;
  int E = 7, k = 3;
  std::vector<float> x, weights, w;
  std::vector<int32_t> ids;
  std::vector<ExpertWeights> experts, shared;
  MoeParams p;
  explicit MoeCase(bool concentrate) {
    auto g = test::rng_for("moe-ep");
    x = test::randn_bf16(g, size_t(T * D));
    weights = test::randn_bf16(g, size_t(T * k), 0.3f);
    w = test::randn_bf16(g, size_t((E + 1) * 3 * I * D), 0.2f);
    std::uniform_int_distribution<int> pick(0, concentrate ? 2 : E - 1);  // concentrate: experts 3.. idle
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int32_t> s;
      for (int i = 0; i < k; ++i) s.push_back(pick(g));
      if (t % 5 == 0) s[1] = s[0];  // a repeated id
      std::sort(s.begin(), s.end());
      ids.insert(ids.end(), s.begin(), s.end());
    }
    for (int e = 0; e <= E; ++e) {
      const float* b = w.data() + size_t(e) * 3 * I * D;
      (e < E ? experts : shared).push_back(ExpertWeights{b, b + I * D, b + 2 * I * D});
    }
    p.T = T, p.D = D, p.I = I, p.E = E, p.k = k, p.n_shared = 1;
    p.x = x.data(), p.ids = ids.data(), p.weights = weights.data();
    p.experts = experts.data(), p.shared = shared.data();
    p.swiglu_limit = 0.5f;  // the clamp is active
  }
};

TEST(ExpertParallel, RangesSumToTheSingleDeviceMoeForEveryRankCount) {
  for (bool concentrate : {false, true}) {
    MoeCase c(concentrate);
    std::vector<float> ref(size_t(c.T * c.D));
    MoeParams p = c.p;
    p.out = ref.data();
    const char* why = moe_check(p);
    ASSERT_EQ(why, nullptr) << why;
    moe_experts(p);
    for (int n = 1; n <= 8; ++n) {
      // What moe_experts_parallel does, every rank in this process: each rank's range, gathered in
      // rank order into the slots, then the sum.
      std::vector<float> y_slot(size_t(c.T * c.k * c.D), -7.0f);
      int64_t covered = 0;
      for (int r = 0; r < n; ++r) {
        const ExpertRange e = expert_range(c.E, r, n);
        const std::vector<int64_t> pairs = moe_pairs(c.p, e.first, e.last);
        std::vector<float> y(pairs.size() * size_t(c.D));
        moe_routed_outputs(c.p, e.first, e.last, y.data());
        for (size_t i = 0; i < pairs.size(); ++i)
          std::copy(y.begin() + std::ptrdiff_t(i * size_t(c.D)), y.begin() + std::ptrdiff_t((i + 1) * size_t(c.D)),
                    y_slot.begin() + pairs[i] * c.D);
        covered += int64_t(pairs.size());
      }
      EXPECT_EQ(covered, c.T * c.k) << n << " ranks: every pair exactly once";
      std::vector<float> out(size_t(c.T * c.D));
      moe_combine(c.p, y_slot.data(), out.data());
      EXPECT_TRUE(bitwise_equal(out, ref)) << n << " ranks" << (concentrate ? ", idle ranks" : "");
    }
  }
}

// The backward in parts, every rank in this process: each rank's range (its experts' weight gradients,
// its pairs' input and routing-weight gradients), gathered in rank order, then the combine; dx,
// dweights, the shared experts' gradients and each routed expert's gradients from its owner equal
// moe_experts_backward's bit for bit, for every rank count.
TEST(ExpertParallel, BackwardRangesCombineToTheSingleDeviceBackward) {
  for (bool concentrate : {false, true}) {
    MoeCase c(concentrate);
    auto g = test::rng_for("moe-ep-backward");
    const std::vector<float> dout = test::randn_bf16(g, size_t(c.T * c.D));
    const std::vector<float> dx0 = test::randn_bf16(g, size_t(c.T * c.D));  // dx is added to
    const size_t ID = size_t(c.I * c.D);
    struct Grads {
      std::vector<float> routed, shared, dx, dweights;
      std::vector<ExpertGrads> eg, sg;
      Grads(const MoeCase& c, const std::vector<float>& dx0, size_t ID)
          : routed(size_t(c.E) * 3 * ID, 0.0f), shared(3 * ID, 0.0f), dx(dx0), dweights(size_t(c.T * c.k), -3.0f) {
        for (int e = 0; e < c.E; ++e) {
          float* b = routed.data() + size_t(e) * 3 * ID;
          eg.push_back(ExpertGrads{b, b + ID, b + 2 * ID});
        }
        sg.push_back(ExpertGrads{shared.data(), shared.data() + ID, shared.data() + 2 * ID});
      }
      MoeBwdParams params(const MoeCase& c, const std::vector<float>& dout) {
        MoeBwdParams p;
        p.fwd = c.p;
        p.dout = dout.data();
        p.dx = dx.data();
        p.dweights = dweights.data();
        p.grads = eg.data();
        p.shared_grads = sg.data();
        return p;
      }
    };
    Grads ref(c, dx0, ID);
    moe_experts_backward(ref.params(c, dout));
    for (int n = 1; n <= 8; ++n) {
      Grads got(c, dx0, ID);
      std::vector<float> dx_pairs, dw_pairs;
      std::vector<float> routed(size_t(c.E) * 3 * ID, 0.0f);
      for (int r = 0; r < n; ++r) {
        Grads rank(c, dx0, ID);  // each rank its own gradient buffers
        const ExpertRange e = expert_range(c.E, r, n);
        const size_t m = moe_pairs(c.p, e.first, e.last).size();
        std::vector<float> dxp(m * size_t(c.D), -5.0f), dwp(m, -5.0f);
        moe_backward_routed(rank.params(c, dout), e.first, e.last, dxp.data(), dwp.data());
        dx_pairs.insert(dx_pairs.end(), dxp.begin(), dxp.end());
        dw_pairs.insert(dw_pairs.end(), dwp.begin(), dwp.end());
        for (int x = 0; x < c.E; ++x) {
          const auto from = rank.routed.begin() + std::ptrdiff_t(size_t(x) * 3 * ID);
          if (x >= e.first && x < e.last)
            std::copy(from, from + std::ptrdiff_t(3 * ID), routed.begin() + std::ptrdiff_t(size_t(x) * 3 * ID));
          else
            EXPECT_TRUE(std::all_of(from, from + std::ptrdiff_t(3 * ID), [](float v) { return v == 0.0f; }))
                << "rank " << r << " of " << n << " touched expert " << x;
        }
      }
      moe_backward_combine(got.params(c, dout), dx_pairs.data(), dw_pairs.data());
      const std::string what = std::to_string(n) + " ranks" + (concentrate ? ", idle ranks" : "");
      EXPECT_TRUE(bitwise_equal(got.dx, ref.dx)) << what;
      EXPECT_TRUE(bitwise_equal(got.dweights, ref.dweights)) << what;
      EXPECT_TRUE(bitwise_equal(got.shared, ref.shared)) << what;
      EXPECT_TRUE(bitwise_equal(routed, ref.routed)) << what;
    }
  }
}

TEST(ExpertParallel, RangesPartitionTheExperts) {
  for (int E : {1, 6, 8, 256})
    for (int n = 1; n <= 9; ++n) {
      int next = 0;
      for (int r = 0; r < n; ++r) {
        const ExpertRange e = expert_range(E, r, n);
        EXPECT_EQ(e.first, next);
        EXPECT_LE(e.last - e.first, (E + n - 1) / n);
        EXPECT_GE(e.last - e.first, E / n);
        next = e.last;
      }
      EXPECT_EQ(next, E);
    }
}

// Data parallel: each rank holds its own tokens (a rank with none among them), dispatches their pairs to
// the experts' owners and back, and gets for every token the row the single-device moe_experts gives
// that token in the whole batch, for 1..6 ranks (ranks as threads; test/thread_ranks.h).
TEST(ExpertParallel, DispatchGivesEachRankTheSingleDeviceRowsOfItsTokens) {
  for (bool concentrate : {false, true}) {
    MoeCase c(concentrate);
    std::vector<float> ref(size_t(c.T * c.D));
    MoeParams whole = c.p;
    whole.out = ref.data();
    moe_experts(whole);
    for (int n = 1; n <= 6; ++n) {
      // Rank r's tokens: a block of the batch; from 3 ranks on, the last rank has none.
      const int holders = n >= 3 ? n - 1 : n;
      std::vector<std::vector<float>> out(static_cast<size_t>(n));
      test::ThreadRanks::run(n, [&](Communicator& comm) {
        const int r = comm.rank();
        const BlockRange b = r < holders ? block_range(int(c.T), r, holders) : BlockRange{int(c.T), int(c.T)};
        MoeParams p = c.p;
        p.T = b.size();
        p.x = c.x.data() + int64_t(b.first) * c.D;
        p.ids = c.ids.data() + int64_t(b.first) * c.k;
        p.weights = c.weights.data() + int64_t(b.first) * c.k;
        out[size_t(r)].assign(size_t(p.T * c.D), -9.0f);
        p.out = out[size_t(r)].data();
        moe_experts_dispatch(p, comm);
      });
      std::vector<float> got;
      for (const auto& o : out) got.insert(got.end(), o.begin(), o.end());
      EXPECT_TRUE(bitwise_equal(got, ref)) << n << " ranks" << (concentrate ? ", idle experts" : "");
    }
  }
}

// The whole forward with the sequences split among 2, 3 and 4 ranks (fewer sequences than ranks at 4:
// a rank runs none and only serves its experts): every sequence's log-probs, decisions and digests of
// every tensor equal the one-process forward of the whole batch, on tiny (8 experts) and tiny-b (6).
TEST(ExpertParallel, SplitSequencesForwardEqualsOneProcess) {
  for (const char* preset : {"tiny", "tiny-b"}) {
    const Weights& w = test::tiny_by_name(preset);
    const int V = w.config().vocab_size;
    const std::vector<std::vector<int32_t>> batch = {random_tokens(41, V, 1), random_tokens(9, V, 2),
                                                     random_tokens(64, V, 3)};
    DecisionLog ref_log;
    RunOptions ro;
    ro.observer = &ref_log;
    const ForwardResult ref = forward(w, batch, ro);
    for (int n : {2, 3, 4}) {
      std::vector<ForwardResult> got(static_cast<size_t>(n));
      std::vector<DecisionLog> logs(static_cast<size_t>(n));
      test::ThreadRanks::run(n, [&](Communicator& comm) {
        const BlockRange b = sequence_range(int(batch.size()), comm.rank(), n);
        RunOptions o;
        o.experts = &comm;
        o.split_sequences = true;
        o.threads = 1;
        o.observer = &logs[size_t(comm.rank())];
        got[size_t(comm.rank())] =
            forward(w, std::vector<std::vector<int32_t>>(batch.begin() + b.first, batch.begin() + b.last), o);
      });
      for (int r = 0; r < n; ++r) {
        const BlockRange b = sequence_range(int(batch.size()), r, n);
        ASSERT_EQ(int(got[size_t(r)].seqs.size()), b.size()) << preset << ", " << n << " ranks, rank " << r;
        for (int i = 0; i < b.size(); ++i) {
          const int s = b.first + i;
          const std::string what = std::string(preset) + ", " + std::to_string(n) + " ranks, sequence " +
                                   std::to_string(s) + " on rank " + std::to_string(r);
          EXPECT_TRUE(bitwise_equal(got[size_t(r)].seqs[size_t(i)].logprobs, ref.seqs[size_t(s)].logprobs)) << what;
          for (int L = 0; L < w.config().num_hidden_layers; ++L) {
            const auto& a = logs[size_t(r)].routing.at({i, L});
            const auto& e = ref_log.routing.at({s, L});
            EXPECT_EQ(a.ids, e.ids) << what << " layer " << L;
            EXPECT_TRUE(bitwise_equal(a.weights, e.weights)) << what << " layer " << L;
            const auto& m = logs[size_t(r)].mhc.at({{i, L}, Sublayer::ffn});
            const auto& me = ref_log.mhc.at({{s, L}, Sublayer::ffn});
            EXPECT_TRUE(bitwise_equal(m.comb, me.comb)) << what << " layer " << L;
          }
        }
      }
    }
  }
}

// A communicator of GPU memory (NCCL's kind) given to the CPU backend is refused before any collective,
// naming the layer and the transport. Its collectives are never reached (reaching one fails the test).
class GpuMemoryCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 2; }
  void all_gather_v(const void*, void*, const std::vector<int64_t>&) override {
    ADD_FAILURE() << "a collective was reached";
  }
  void all_to_all_v(const void*, const std::vector<int64_t>&, void*, const std::vector<int64_t>&) override {
    ADD_FAILURE() << "a collective was reached";
  }
  [[noreturn]] void abort(const std::string& message, int) override { throw std::runtime_error(message); }
  std::string transport() const override { return "NCCL"; }
  bool device_memory() const override { return true; }
  int64_t bytes_received() const override { return 0; }
};

TEST(ExpertParallel, TheCpuBackendRefusesACommunicatorOfGpuMemory) {
  GpuMemoryCommunicator c;
  RunOptions o;
  o.experts = &c;
  try {
    forward(test::tiny(), {random_tokens(9, 512, 3)}, o);
    ADD_FAILURE() << "the CPU backend took a communicator of GPU memory";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("layer 0: expert parallelism over NCCL moves GPU memory, but the forward "
                                         "runs on the CPU: use MPI on CPUs"),
              std::string::npos)
        << e.what();
  }
}

// ---- through the CLI under mpirun ---------------------------------------------------------------

// mpirun as it runs here: root allowed (CI containers), more ranks than cores allowed, no
// cross-memory attach between ranks (containers often forbid it).
std::string mpirun(int n) {
  return "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 "
         "OMPI_MCA_btl_vader_single_copy_mechanism=none timeout 300 mpirun -np " +
         std::to_string(n) + " " + DSV4_CLI_PATH + " ";
}

// Why the MPI tests cannot run here ("" when they can): no mpirun, a dsv4 built without MPI, or an
// MPI runtime that cannot start two processes on this machine.
const std::string& mpi_missing() {
  static const std::string why = []() -> std::string {
    if (test::run_shell("command -v mpirun").code != 0) return "mpirun not found";
    if (test::run_cli("forward --preset tiny --random 4 --ep 2").out.find("built without MPI") != std::string::npos)
      return "dsv4 built without MPI";
    const auto r = test::run_shell(mpirun(2) + "--version");
    if (r.code != 0) return "mpirun cannot start 2 processes here: " + r.out.substr(0, 400);
    return "";
  }();
  return why;
}
#define DSV4_REQUIRE_MPI() \
  if (!mpi_missing().empty()) GTEST_SKIP() << mpi_missing()

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

TEST(ExpertParallelCli, ForwardIsByteIdenticalForEveryRankCount) {
  DSV4_REQUIRE_MPI();
  test::TempDir d;
  for (const char* preset : {"tiny", "tiny-b"}) {
    const std::string args = std::string("forward --preset ") + preset + " --seed 7 --random 160 --threads 1";
    auto r = test::run_cli(args + " --out " + (d / "one.json"));
    ASSERT_EQ(r.code, 0) << r.out;
    const std::string one = slurp(d / "one.json");
    for (int n : {1, 2, 4}) {
      r = test::run_shell(mpirun(n) + args + " --ep " + std::to_string(n) + " --out " + (d / "ep.json"));
      ASSERT_EQ(r.code, 0) << preset << " --ep " << n << ": " << r.out;
      EXPECT_EQ(slurp(d / "ep.json"), one) << preset << " --ep " << n;
      std::remove((d / "ep.json").c_str());
    }
  }
}

TEST(ExpertParallelCli, RecordedInParallelReplaysInOneProcess) {
  DSV4_REQUIRE_MPI();
  test::TempDir d;
  auto r = test::run_shell(mpirun(2) + "record --preset tiny-b --seed 7 --random 150 --threads 1 --ep 2 --out " +
                           (d / "ep.h5"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = test::run_cli("replay " + (d / "ep.h5"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("recorded with expert parallel over 2 MPI ranks"), std::string::npos) << r.out;
  // The same step recorded in one process: the same decisions and digests (diff finds nothing).
  r = test::run_cli("record --preset tiny-b --seed 7 --random 150 --threads 1 --out " + (d / "one.h5"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = test::run_cli("diff " + (d / "one.h5") + " " + (d / "ep.h5") + " --json " + (d / "diff.json"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("first divergence: none (every digest agrees)"), std::string::npos) << r.out;
}

// Replay across layouts: recorded over 4 ranks, replayed over 2 ranks and in one process, bitwise,
// the report naming both layouts; and a one-process recording replayed over 2 ranks.
TEST(ExpertParallelCli, ReplayAcrossLayouts) {
  DSV4_REQUIRE_MPI();
  test::TempDir d;
  auto r = test::run_shell(mpirun(4) + "record --preset tiny --seed 7 --random 90 --threads 1 --ep 4 --out " +
                           (d / "ep4.h5"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = test::run_shell(mpirun(2) + "replay --threads 1 --ep 2 " + (d / "ep4.h5"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("recorded with expert parallel over 4 MPI ranks, replayed with expert parallel over 2 MPI "
                       "ranks"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("step 0: bit-identical"), std::string::npos) << r.out;
  // Rank 0 alone reports.
  EXPECT_EQ(r.out.find("replay of "), r.out.rfind("replay of ")) << r.out;
  r = test::run_cli("replay --threads 1 " + (d / "ep4.h5"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("replayed with one process"), std::string::npos) << r.out;

  r = test::run_cli("record --preset tiny --seed 7 --random 90 --threads 1 --out " + (d / "one.h5"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = test::run_shell(mpirun(2) + "replay --threads 1 --ep 2 " + (d / "one.h5"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("recorded in one process, replayed with expert parallel over 2 MPI ranks"),
            std::string::npos)
      << r.out;

  // A generation step is not re-executed expert-parallel: named, exit 2.
  {
    std::ofstream f(d / "prompts.jsonl");
    f << R"({"id": "a", "prompt": [1, 2, 3, 4, 5], "seed": 1})" << "\n";
  }
  r = test::run_cli("generate --preset tiny --seed 7 --prompts " + (d / "prompts.jsonl") +
                    " --max-new-tokens 4 --quiet --out " + (d / "gen.jsonl") + " --record " + (d / "gen.h5"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = test::run_shell(mpirun(2) + "replay --threads 1 --ep 2 " + (d / "gen.h5"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("step 0 is of kind 'generate'; an expert-parallel replay (--ep) re-executes prefill and "
                       "training steps"),
            std::string::npos)
      << r.out;

  // Bad input ends every rank with the error and exit 2, never a hang.
  r = test::run_shell(mpirun(2) + "replay --threads 1 --ep 2 --model " + (d / "nowhere") + " " + (d / "one.h5"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("nowhere"), std::string::npos) << r.out;
}

// A training step expert-parallel: the updated checkpoint and optimizer state byte-identical to one
// process for 2 and 4 ranks (tiny-b's 6 experts: uneven at 4); its recording replays in one process and
// over 2 ranks bitwise (forward, every gradient, the update), the layouts named.
TEST(ExpertParallelCli, TrainStepIsByteIdenticalForEveryRankCount) {
  DSV4_REQUIRE_MPI();
  test::TempDir d;
  {
    std::ofstream f(d / "samples.jsonl");
    f << R"({"id": "a", "prompt": [1, 2, 3, 4, 5], "response": [9, 8, 7, 6, 5, 4, 3], "reward": 1, "group": "g"})"
      << "\n"
      << R"({"id": "b", "prompt": [1, 2, 3, 4, 5], "response": [11, 12, 13, 14], "reward": 0, "group": "g"})"
      << "\n"
      << R"({"id": "c", "prompt": [40, 41], "response": [50, 51, 52, 53, 54, 55, 56], "reward": 0.5, "group": "h"})"
      << "\n";
  }
  auto r = test::run_cli("model init --preset tiny-b --seed 7 --out " + (d / "m0"));
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string args = "train-step --model " + (d / "m0") + " --data " + (d / "samples.jsonl") +
                           " --lr 1e-3 --threads 1 --quiet --out-model ";
  r = test::run_cli(args + (d / "one"));
  ASSERT_EQ(r.code, 0) << r.out;
  for (int n : {2, 4}) {
    const std::string out = d / ("ep" + std::to_string(n));
    r = test::run_shell(mpirun(n) + args + out + " --ep " + std::to_string(n) + " --record " + out + ".h5");
    ASSERT_EQ(r.code, 0) << "--ep " << n << ": " << r.out;
    for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
      const std::string a = slurp(d / "one" + "/" + file), b = slurp(out + "/" + file);
      EXPECT_FALSE(a.empty()) << file;
      EXPECT_TRUE(a == b) << file << " differs at --ep " << n;
    }
  }
  r = test::run_cli("replay --threads 1 " + (d / "ep4.h5"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("recorded with expert parallel over 4 MPI ranks, replayed with one process"),
            std::string::npos)
      << r.out;
  r = test::run_shell(mpirun(2) + "replay --threads 1 --ep 2 " + (d / "ep4.h5"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("replayed with expert parallel over 2 MPI ranks"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("step 0: bit-identical"), std::string::npos) << r.out;
}

// --dp: the ranks split the sequences. `forward` has one sequence: rank 0 runs it, the other ranks
// serve their experts; the JSON equals one process's bytes for 2 and 4 ranks.
TEST(ExpertParallelCli, SplitSequencesForwardIsByteIdentical) {
  DSV4_REQUIRE_MPI();
  test::TempDir d;
  for (const char* preset : {"tiny", "tiny-b"}) {
    const std::string args = std::string("forward --preset ") + preset + " --seed 7 --random 160 --threads 1";
    auto r = test::run_cli(args + " --out " + (d / "one.json"));
    ASSERT_EQ(r.code, 0) << r.out;
    for (int n : {2, 4}) {
      r = test::run_shell(mpirun(n) + args + " --ep " + std::to_string(n) + " --dp --out " + (d / "dp.json"));
      ASSERT_EQ(r.code, 0) << preset << " --ep " << n << " --dp: " << r.out;
      EXPECT_EQ(slurp(d / "dp.json"), slurp(d / "one.json")) << preset << " --ep " << n << " --dp";
      std::remove((d / "dp.json").c_str());
    }
  }
}

// A batch of sequences (uneven lengths) on 2 and 4 ranks, split: each rank writes its own trace,
// rank 0 the joined one; the joined trace reads as one trace (info, validate), replays in one process
// and over 2 ranks bitwise naming the layout, equals a one-process recording in every digest (diff),
// and travels as a bundle with its parts. At 4 ranks with 3 sequences one rank runs none.
TEST(ExpertParallelCli, SplitSequencesRecordJoinsTheRanksTraces) {
  DSV4_REQUIRE_MPI();
  test::TempDir d;
  {
    std::ofstream f(d / "batch.jsonl");
    f << "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]\n[30, 31, 32]\n";
    f << "[9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29]\n";
  }
  const std::string rec = "record --preset tiny-b --seed 7 --threads 1 --batch " + (d / "batch.jsonl");
  auto r = test::run_cli(rec + " --out " + (d / "one.h5"));
  ASSERT_EQ(r.code, 0) << r.out;
  for (int n : {2, 4}) {
    const std::string j = d / ("dp" + std::to_string(n) + ".h5");
    r = test::run_shell(mpirun(n) + rec + " --ep " + std::to_string(n) + " --dp --out " + j);
    ASSERT_EQ(r.code, 0) << n << " ranks: " << r.out;
    EXPECT_NE(r.out.find("joins the " + std::to_string(n) + " ranks' traces"), std::string::npos) << r.out;
    for (int q = 0; q < n; ++q)
      EXPECT_TRUE(std::ifstream(d / ("dp" + std::to_string(n) + ".rank" + std::to_string(q) + ".h5")).good())
          << "rank " << q << " of " << n;
    r = test::run_cli("trace info --json " + j);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("\"name\": \"dp" + std::to_string(n) + ".rank" + std::to_string(n - 1) + ".h5\""),
              std::string::npos)
        << r.out;
    EXPECT_NE(r.out.find("\"seq_lengths\": [\n        17,\n        3,\n        29\n      ]"), std::string::npos) << r.out;
    r = test::run_cli("trace validate " + j);
    EXPECT_EQ(r.code, 0) << r.out;
    r = test::run_cli("replay --threads 1 " + j);
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("recorded with expert parallel over " + std::to_string(n) +
                         " MPI ranks, each running its own sequences, replayed with one process"),
              std::string::npos)
        << r.out;
    r = test::run_cli("diff " + (d / "one.h5") + " " + j);
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("first divergence: none (every digest agrees)"), std::string::npos) << r.out;
    // A rank's own trace is a trace of its sequences.
    r = test::run_cli("trace info " + (d / ("dp" + std::to_string(n) + ".rank1.h5")));
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find(n == 2 ? "sequences [29]" : "sequences [3]"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("rank           1 of " + std::to_string(n)), std::string::npos) << r.out;
  }
  r = test::run_shell(mpirun(2) + "replay --threads 1 --ep 2 " + (d / "dp4.h5"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("replayed with expert parallel over 2 MPI ranks"), std::string::npos) << r.out;

  // A bundle carries the parts; it replays from another folder with the originals gone.
  r = test::run_cli("trace bundle " + (d / "dp2.h5") + " --out " + (d / "bundle"));
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* f : {"dp2.h5", "dp2.rank0.h5", "dp2.rank1.h5"}) std::remove((d / f).c_str());
  r = test::run_cli("replay --threads 1 " + (d / "bundle") + "/dp2.h5");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("step 0: bit-identical"), std::string::npos) << r.out;

  // A missing part, or one whose bytes changed, is named.
  std::remove((d / "dp4.rank2.h5").c_str());
  r = test::run_cli("trace info " + (d / "dp4.h5"));
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("part 2 (" + (d / "dp4.rank2.h5") + ") is missing"), std::string::npos) << r.out;
  {
    std::fstream f(d / "dp4.rank1.h5", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4000);
    f.put('\x5a');
  }
  r = test::run_cli("replay " + (d / "dp4.h5"));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("dp4.rank1.h5"), std::string::npos) << r.out;
}

// A rank killed while the ranks record a second step: every rank ends non-zero within a bounded
// time; the joined trace still holds the first step, complete and sealed; salvage copies it into a
// trace that holds its sequences itself (it replays with the ranks' traces gone).
TEST(ExpertParallelCli, AKilledRankLeavesTheJoinedStepsSalvageable) {
  DSV4_REQUIRE_MPI();
  test::TempDir d;
  {
    std::ofstream f(d / "batch.jsonl");
    f << "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]\n[30, 31, 32, 33, 34, 35, 36, 37, 38]\n";
  }
  const std::string rec = "record --preset tiny --seed 7 --threads 1 --ep 2 --dp --batch " + (d / "batch.jsonl") +
                          " --out " + (d / "j.h5");
  auto r = test::run_shell(mpirun(2) + rec);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto t0 = std::chrono::steady_clock::now();
  // Open MPI's ranks on this host inherit mpirun's environment.
  r = test::run_shell("DSV4_FAULT=kill-mid-step DSV4_FAULT_RANK=1 " + mpirun(2) + rec + " --append");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_LT(secs, 120.0) << r.out;
  r = test::run_cli("trace info " + (d / "j.h5"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("steps: 1\n"), std::string::npos) << r.out;
  r = test::run_cli("trace validate " + (d / "j.h5"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("part 1: j.rank1.h5 (seal: open"), std::string::npos) << r.out;
  r = test::run_cli("trace salvage " + (d / "j.h5") + " --out " + (d / "s.h5"));
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* f : {"j.h5", "j.rank0.h5", "j.rank1.h5"}) std::remove((d / f).c_str());
  r = test::run_cli("replay --threads 1 " + (d / "s.h5"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("step 0: bit-identical"), std::string::npos) << r.out;
}

// Each rank loads only its own routed experts from the checkpoint: the forward's bytes are the one-process
// bytes, the weights a rank holds shrink with the rank count, and a recording made so replays over 2
// ranks (each loading its own) and in one process; the trace's model digest is the whole checkpoint's.
TEST(ExpertParallelCli, EachRankLoadsOnlyItsOwnExperts) {
  DSV4_REQUIRE_MPI();
  test::TempDir d;
  auto r = test::run_cli("model init --preset tiny-b --seed 5 --out " + (d / "m"));
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string args = "forward --model " + (d / "m") + " --random 120 --threads 1 --out ";
  r = test::run_cli(args + (d / "one.json"));
  ASSERT_EQ(r.code, 0) << r.out;
  const auto held = [](const std::string& out) {  // "... holds 22.0 MB of weights" / "31.5 MB of weights"
    const size_t at = out.find(" MB of weights");
    if (at == std::string::npos) return -1.0;
    const size_t from = out.rfind(' ', at - 1);
    return std::stod(out.substr(from + 1, at - from - 1));
  };
  const double one = held(r.out);
  ASSERT_GT(one, 0) << r.out;
  double last = one;
  for (int n : {2, 4}) {
    r = test::run_shell(mpirun(n) + args + (d / "ep.json") + " --ep " + std::to_string(n));
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_EQ(slurp(d / "ep.json"), slurp(d / "one.json")) << "--ep " << n;
    EXPECT_LT(held(r.out), last) << "--ep " << n << ": " << r.out;
    last = held(r.out);
  }
  r = test::run_shell(mpirun(2) + "record --model " + (d / "m") + " --random 90 --threads 1 --ep 2 --out " +
                      (d / "ep.h5"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = test::run_shell(mpirun(2) + "replay --threads 1 --ep 2 " + (d / "ep.h5"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("step 0: bit-identical"), std::string::npos) << r.out;
  r = test::run_cli("replay --threads 1 " + (d / "ep.h5"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("WEIGHTS DIFFER"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("step 0: bit-identical"), std::string::npos) << r.out;
}

TEST(ExpertParallelCli, SplitSequencesNeedRanksOnTheCpu) {
  auto r = test::run_cli("record --preset tiny --random 20 --dp --out x.h5");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--dp splits the sequences among the --ep ranks: give --ep N with N > 1"), std::string::npos)
      << r.out;
  r = test::run_cli("forward --preset tiny --random 20 --ep 2 --dp --device cuda");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("--dp runs on the CPU only (MPI)"), std::string::npos) << r.out;
}

TEST(ExpertParallelCli, LauncherMismatchesAreNamed) {
  DSV4_REQUIRE_MPI();
  auto r = test::run_cli("forward --preset tiny --random 20 --ep 2");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("mpirun -np 2"), std::string::npos) << r.out;
  r = test::run_shell(mpirun(2) + "forward --preset tiny --random 20 --threads 1 --ep 3");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("--ep 3 but the job has 2 processes"), std::string::npos) << r.out;
  // An error on the ranks after the communicator exists ends the job with the message, every rank.
  r = test::run_shell(mpirun(2) + "forward --preset tiny --tokens 1,2,999999 --threads 1 --ep 2");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(" of 2: error: forward: sequence 0 position 2: token id 999999"), std::string::npos)
      << r.out;
}

// A rank killed mid-run (SIGKILL, no chance to clean up): mpirun ends the other rank, which would
// otherwise wait in its next collective, and exits non-zero, within a bounded time.
TEST(ExpertParallelCli, AKilledRankEndsTheJob) {
  DSV4_REQUIRE_MPI();
  test::TempDir d;
  const auto t0 = std::chrono::steady_clock::now();
  {
    std::ofstream f(d / "kill.sh");
    f << mpirun(2) << "forward --preset tiny --seed 7 --random 20000 --threads 1 --ep 2 --out " << (d / "x.json")
      << " &\njob=$!\nsleep 2\npkill -KILL -n -f 'dsv4 forward --preset tiny --seed 7 --random 20000'\nwait $job\n";
  }
  const auto r = test::run_shell("bash " + (d / "kill.sh"));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_LT(secs, 120.0) << r.out;
  EXPECT_FALSE(std::ifstream(d / "x.json").good()) << "a result was written by a job that lost a rank";
}

}  // namespace
}  // namespace dsv4
