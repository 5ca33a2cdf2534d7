// main() of the GUI test binaries: an offscreen QApplication (unless QT_QPA_PLATFORM is set), user
// settings redirected to a temporary directory, then GoogleTest.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <hdf5.h>
#include <sys/file.h>
#include <unistd.h>

#include <QApplication>
#include <QElapsedTimer>
#include <QThread>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <vector>

#include "capture/trace_reader.h"
#include "cli_util.h"
#include "gui_test_util.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace dsv4::test {

gui::Dataset synthetic_pair(int64_t tokens, int layers) {
  auto summary = std::make_shared<gui::LoadSummary>();
  summary->a.config = preset("tiny");
  if (layers > 0) {
    summary->a.config.num_hidden_layers = layers;
    summary->a.config.compress_ratios.assign(size_t(layers), 4);
  }
  summary->a.steps = {TraceStepInfo{}};
  summary->a.steps[0].complete = true;
  summary->b = summary->a;
  summary->layers = summary->a.config.num_hidden_layers;
  summary->seq_lengths = {tokens};
  gui::Dataset d;
  d.summary = summary;
  auto seq = std::make_shared<gui::SeqTokens>();
  seq->T = tokens;
  seq->tokens.assign(size_t(tokens), 1);
  seq->logprobs_a.assign(size_t(tokens - 1), -5.0f);
  seq->logprobs_b = seq->logprobs_a;
  d.seqs = {seq};
  d.chunks.resize(1);
  return d;
}

const TracePair& gui_traces() {
  static const TracePair pair = [] {
    TracePair p;
    const std::string samples = std::string(DSV4_SOURCE_DIR) + "/traces/samples";
    if (fs::exists(samples + "/tiny-train.h5") && fs::exists(samples + "/tiny-rollout.h5")) {
      p = {samples + "/tiny-train.h5", samples + "/tiny-rollout.h5"};
    } else {
      const std::string dir = DSV4_GUI_TRACE_DIR;
      fs::create_directories(dir);
      p = {dir + "/pair-train.h5", dir + "/pair-rollout.h5"};
      // Several test processes may start at once: one records, the others wait on the lock.
      const int fd = ::open((dir + "/.lock").c_str(), O_CREAT | O_RDWR, 0644);
      if (fd >= 0) ::flock(fd, LOCK_EX);
      for (const auto& [path, profile] : {std::pair{p.a, "train"}, std::pair{p.b, "rollout"}}) {
        // Recorded by an older dsv4: record again.
        if (fs::exists(path) && fs::last_write_time(path) < fs::last_write_time(DSV4_CLI_PATH))
          fs::remove(path);
        if (fs::exists(path)) continue;
        const std::string tmp = path + ".tmp.h5";
        fs::remove(tmp);
        fs::remove(tmp + ".incomplete");
        const auto r = run_cli("record --preset tiny --seed 7 --random 96 --token-seed 3 --profile " +
                               std::string(profile) + " --capture 'attn.o@1,moe.out@3,logits' --out " + tmp);
        if (r.code != 0) {
          std::fprintf(stderr, "recording %s failed:\n%s\n", path.c_str(), r.out.c_str());
          std::abort();
        }
        fs::rename(tmp, path);
      }
      if (fd >= 0) {
        ::flock(fd, LOCK_UN);
        ::close(fd);
      }
    }
    p.tokens = TraceReader::open(p.a).steps().at(0).seq_lengths.at(0);
    return p;
  }();
  return pair;
}

const TrainingPair& gui_training_traces() {
  static const TrainingPair pair = [] {
    const std::string dir = std::string(DSV4_GUI_TRACE_DIR) + "/training";
    fs::create_directories(dir);
    TrainingPair p{dir + "/step-a.h5", dir + "/step-b-r3.h5", dir + "/rollout.h5"};
    const int fd = ::open((dir + "/.lock").c_str(), O_CREAT | O_RDWR, 0644);
    if (fd >= 0) ::flock(fd, LOCK_EX);
    const bool stale = [&] {
      for (const std::string& f : {p.a, p.b, p.rollout})
        if (!fs::exists(f) || fs::last_write_time(f) < fs::last_write_time(DSV4_CLI_PATH)) return true;
      return false;
    }();
    if (stale) {
      std::vector<int32_t> prompt, response;
      for (int i = 0; i < 30; ++i) prompt.push_back((37 * i + 11) % 512);
      for (int i = 0; i < 50; ++i) response.push_back((101 * i + 7) % 512);
      auto list = [](const std::vector<int32_t>& v) {
        std::string s;
        for (int32_t x : v) s += (s.empty() ? "" : ", ") + std::to_string(x);
        return s;
      };
      std::ofstream(dir + "/samples.jsonl")
          << R"({"id": "short", "prompt": [1, 2, 3, 4, 5], "response": [9, 8, 7, 6, 5, 4, 3, 2, 1], "advantage": 1})"
          << "\n{\"id\": \"long\", \"prompt\": [" << list(prompt) << "], \"response\": [" << list(response)
          << "], \"advantage\": -0.5}\n";
      std::vector<int32_t> long_tokens = prompt;
      long_tokens.insert(long_tokens.end(), response.begin(), response.end());
      std::ofstream(dir + "/batch.jsonl")
          << "[1, 2, 3, 4, 5, 9, 8, 7, 6, 5, 4, 3, 2, 1]\n[" << list(long_tokens) << "]\n";
      for (const std::string& f : {p.a, p.b, p.rollout}) {
        fs::remove(f);
        fs::remove(f + ".incomplete");
      }
      const std::string step = "train-step --preset tiny --seed 7 --data " + dir +
                               "/samples.jsonl --quiet --capture-params '*' --lr 1e-3 ";
      for (const std::string& cmd :
           {"record --preset tiny --seed 7 --profile rollout --batch " + dir + "/batch.jsonl --out " +
                p.rollout,
            step + "--out-model " + dir + "/m-a --record " + p.a,
            step + "--replay-decisions-from " + p.rollout + " --out-model " + dir + "/m-b --record " + p.b}) {
        const auto r = run_cli(cmd, "OMP_WAIT_POLICY=passive");
        if (r.code != 0) {
          std::fprintf(stderr, "%s failed:\n%s\n", cmd.c_str(), r.out.c_str());
          std::abort();
        }
      }
    }
    if (fd >= 0) {
      ::flock(fd, LOCK_UN);
      ::close(fd);
    }
    return p;
  }();
  return pair;
}

std::string temp_dir(const std::string& name) {
  static const TempDir root;  // removed at the process's exit
  const std::string d = root / name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::string write_not_a_trace(const std::string& dir) {
  const std::string p = dir + "/notes.h5";
  std::ofstream(p) << "this is a text file, not an HDF5 trace\n";
  return p;
}

std::string write_truncated(const std::string& src, const std::string& dir) {
  const std::string p = dir + "/truncated.h5";
  std::ifstream in(src, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::ofstream(p, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size() / 2));
  return p;
}

std::string write_with_version(const std::string& src, const std::string& dir, int version) {
  const std::string p = dir + "/version" + std::to_string(version) + ".h5";
  fs::copy_file(src, p, fs::copy_options::overwrite_existing);
  const hid_t f = H5Fopen(p.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
  if (f < 0) return p;
  const hid_t a = H5Aopen(f, "format_version", H5P_DEFAULT);
  const int32_t v = version;
  if (a >= 0) {
    H5Awrite(a, H5T_NATIVE_INT32, &v);
    H5Aclose(a);
  }
  H5Fclose(f);
  return p;
}

bool wait_until(const std::function<bool()>& pred, int timeout_ms) {
  QElapsedTimer t;
  t.start();
  while (!pred()) {
    if (t.elapsed() > timeout_ms) return false;
    QCoreApplication::processEvents(QEventLoop::AllEvents, 20);
    QThread::msleep(1);
  }
  return true;
}

}  // namespace dsv4::test

int main(int argc, char** argv) {
  if (!std::getenv("QT_QPA_PLATFORM")) setenv("QT_QPA_PLATFORM", "offscreen", 1);
  // Keep the recent-files list of the person running the tests untouched.
  const std::string config = ::testing::TempDir() + "dsv4_gui_config_" + std::to_string(getpid());
  fs::create_directories(config);
  setenv("XDG_CONFIG_HOME", config.c_str(), 1);
  if (!std::getenv("XDG_RUNTIME_DIR")) {  // else Qt warns and makes /tmp/runtime-USER, left behind
    const std::string runtime = config + "/runtime";
    fs::create_directories(runtime);
    fs::permissions(runtime, fs::perms::owner_all, fs::perm_options::replace);
    setenv("XDG_RUNTIME_DIR", runtime.c_str(), 1);
  }
  QApplication app(argc, argv);
  QApplication::setOrganizationName(QStringLiteral("dsv4-test"));
  QApplication::setApplicationName(QStringLiteral("dsv4-view-test"));
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  fs::remove_all(config);
  return rc;
}
