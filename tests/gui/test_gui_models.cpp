// The viewer's models library without widgets: the per-position metrics on hand-made records, the
// staged loader (order, supersession, cancel, reload of a growing trace, typed errors), every model
// under QAbstractItemModelTester, and the models' values against values computed here directly
// from TraceReader and diff_traces; the Gradients model of two training steps against the full
// gradients.
#include <gtest/gtest.h>

// Before any Qt header: Qt's `emit`, `slots` and `signals` macros rewrite such names wherever a
// library header uses them (the libraries avoid them; this order keeps a future slip out of here).
#include "trace_test_util.h"

#include <QAbstractItemModelTester>
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <tuple>
#include <unistd.h>

#include "capture/trace_reader.h"
#include "cli_util.h"
#include "gui/models/bisect_model.h"
#include "gui/models/colour_scale.h"
#include "gui/models/gradient_model.h"
#include "gui/models/heatmap_model.h"
#include "gui/models/metrics.h"
#include "gui/models/navigator_model.h"
#include "gui/models/table_models.h"
#include "gui/models/trace_document.h"
#include "gui_test_util.h"
#include "model/decision_sets.h"
#include "model/error.h"
#include "model/tokens.h"
#include "replay/diff.h"
#include "tiny_model.h"

namespace {

namespace fs = std::filesystem;
using namespace dsv4;
using namespace dsv4::gui;
using dsv4::test::gui_traces;
using dsv4::test::wait_until;

// QAbstractItemModelTester reports through qWarning in Warning mode; collect its complaints.
QStringList g_tester_failures;
void capture_messages(QtMsgType type, const QMessageLogContext&, const QString& msg) {
  if (type != QtDebugMsg && msg.contains(QStringLiteral("FAIL"))) g_tester_failures << msg;
}

struct TesterGuard {
  QtMessageHandler previous;
  TesterGuard() : previous(qInstallMessageHandler(capture_messages)) { g_tester_failures.clear(); }
  ~TesterGuard() { qInstallMessageHandler(previous); }
  void expect_clean() const {
    EXPECT_TRUE(g_tester_failures.isEmpty()) << g_tester_failures.join('\n').toStdString();
  }
};

std::unique_ptr<QAbstractItemModelTester> tester(QAbstractItemModel* m) {
  return std::make_unique<QAbstractItemModelTester>(m,
                                                    QAbstractItemModelTester::FailureReportingMode::Warning);
}

// Loads and waits; returns the error message, empty on success.
struct LoadResult {
  bool finished = false, failed = false, canceled = false;
  LoadError error;
};
LoadResult load(TraceDocument& doc, const std::string& a, const std::string& b = {}, int step_a = 0,
                int step_b = 0) {
  LoadResult r;
  auto c1 = QObject::connect(&doc, &TraceDocument::loadFinished, [&] { r.finished = true; });
  auto c2 = QObject::connect(&doc, &TraceDocument::loadFailed, [&](const LoadError& e) {
    r.failed = true;
    r.error = e;
  });
  auto c3 = QObject::connect(&doc, &TraceDocument::loadCanceled, [&] { r.canceled = true; });
  doc.open(QString::fromStdString(a), QString::fromStdString(b), step_a, step_b);
  EXPECT_TRUE(wait_until([&] { return r.finished || r.failed || r.canceled; }));
  QObject::disconnect(c1);
  QObject::disconnect(c2);
  QObject::disconnect(c3);
  return r;
}

std::set<int32_t> row_set(const std::vector<int32_t>& ids, int64_t width, int64_t t) {
  std::set<int32_t> s;
  for (int64_t j = 0; j < width; ++j)
    if (ids[t * width + j] >= 0) s.insert(ids[t * width + j]);
  return s;
}

size_t common(const std::set<int32_t>& a, const std::set<int32_t>& b) {
  size_t n = 0;
  for (int32_t x : a) n += b.count(x);
  return n;
}

double heat_value(const HeatmapModel& m, int row, int col) {
  const QVariant v = m.data(m.index(row, col), HeatmapModel::ValueRole);
  return v.isValid() ? v.toDouble() : NAN;
}

// ---- metrics on hand-made records ------------------------------------------------------------

TEST(GuiMetrics, SetMetricsPerPosition) {
  IndexerRecord a{3, 2, {0, 2, 1, -1, -1, -1}, {0.5f, 0.1f, INFINITY}};
  IndexerRecord b{3, 2, {0, 1, 1, -1, -1, -1}, {0.4f, 0.2f, INFINITY}};
  const auto ov = indexer_overlap(a, b);
  ASSERT_EQ(ov.size(), 3u);
  EXPECT_FLOAT_EQ(ov[0], 0.5f);  // {0,2} vs {0,1}
  EXPECT_FLOAT_EQ(ov[1], 1.0f);  // {1} vs {1}
  EXPECT_FLOAT_EQ(ov[2], 1.0f);  // both empty
  RoutingRecord ra{2, 2, false, {1, 3, 0, 5}, {0.5f, 0.5f, 0.6f, 0.4f}, {0.1f, 0.2f}};
  RoutingRecord rb{2, 2, false, {1, 4, 0, 5}, {0.5f, 0.5f, 0.6f, 0.4f}, {0.1f, 0.2f}};
  const auto ag = routing_agreement(ra, rb);
  EXPECT_FLOAT_EQ(ag[0], 1.0f / 3);
  EXPECT_FLOAT_EQ(ag[1], 1.0f);
  const auto load = expert_load(ra, 6);
  EXPECT_EQ(load, (std::vector<float>{1, 1, 0, 1, 0, 1}));
  const auto mm = min_margin(ra.margin, &rb.margin);
  EXPECT_EQ(mm, (std::vector<float>{0.1f, 0.2f}));
}

TEST(GuiMetrics, MhcDigestsAndRelL2) {
  LayerRecords a, b;
  a.mhc[0] = MhcRecord{2, 1, {1, 2}, {3, 4}, {5, 6}};
  b.mhc[0] = MhcRecord{2, 1, {1, 2.5f}, {3, 4}, {5, 6}};
  const auto d = mhc_difference(a, b, 2);
  EXPECT_FLOAT_EQ(d[0], 0.0f);
  EXPECT_FLOAT_EQ(d[1], 0.5f);
  EXPECT_TRUE(std::isnan(mhc_difference(a, LayerRecords{}, 2)[0]));

  DigestTable da, db;
  da.records = {{"attn.q", 0, 3, 0}, {"attn.compressed_kv", 0, 1, 3}, {"moe.out", 0, 3, 4}};
  da.values = {1, 2, 3, 9, 4, 5, 6};
  db = da;
  db.values[1] = 20;  // attn.q row 1
  db.values[3] = 90;  // a compressed group: not a token row
  db.values[6] = 60;  // moe.out row 2
  const auto frac = digest_difference(da, db, 0, 3);
  EXPECT_EQ(frac, (std::vector<float>{0.0f, 0.5f, 0.5f}));
  EXPECT_TRUE(std::isnan(digest_difference(da, db, 1, 3)[0]));
  EXPECT_EQ(differing_tensors(da, db, 0, 2), std::vector<std::string>{"moe.out"});

  TensorCopy ta{DType::f32, {2, 2}, {3, 4, 1, 0}, {}};
  TensorCopy tb{DType::f32, {2, 2}, {3, 4, 1, 1}, {}};
  const auto rel = row_rel_l2(ta, tb);
  EXPECT_FLOAT_EQ(rel[0], 0.0f);
  EXPECT_FLOAT_EQ(rel[1], 1.0f);
  TensorCopy tc{DType::f32, {1, 2}, {0, 0}, {}};
  TensorCopy td{DType::f32, {1, 2}, {0, 1}, {}};
  EXPECT_TRUE(std::isinf(row_rel_l2(tc, td)[0]));
  EXPECT_THROW(row_rel_l2(ta, tc), InputError);
}

// The detail's full tensors come in execution order (the digest records'), whatever order the rows
// arrive in, and the first whose row differs is named.
TEST(GuiMetrics, DetailTensorsInExecutionOrderFromTheFirstDiffering) {
  LoadSummary s;
  s.a.config = preset("tiny");
  s.b = s.a;
  s.layers = s.a.config.num_hidden_layers;
  s.seq_lengths = {4};
  SeqTokens seq;
  seq.T = 4;
  seq.tokens = {1, 2, 3, 4};
  for (const char* name : {"attn.q", "attn.o", "moe.out"}) seq.digests_a.records.push_back({name, 1, 4, 0});
  seq.digests_a.records.push_back({"attn.q", 2, 4, 0});  // another layer: not this one's order
  LayerChunk chunk;
  chunk.layer = 1;
  auto row = [](const char* name, float db) {
    return TensorRowPair{name, DType::f32, 2, {1, 2}, {1, 2 + db}};
  };
  const CellDetail d =
      cell_detail(s, seq, chunk, nullptr, 2, {row("moe.out", 0.5f), row("attn.o", 0), row("attn.q", 0.25f)});
  ASSERT_EQ(d.tensors.size(), 3u);
  EXPECT_EQ(d.tensors[0].name, "attn.q");
  EXPECT_EQ(d.tensors[1].name, "attn.o");
  EXPECT_EQ(d.tensors[2].name, "moe.out");
  EXPECT_EQ(d.first_differing_tensor, 0);
  const CellDetail e =
      cell_detail(s, seq, chunk, nullptr, 2, {row("moe.out", 0.5f), row("attn.q", 0), row("attn.o", 0)});
  EXPECT_EQ(e.first_differing_tensor, 2);
  EXPECT_GT(e.tensors[2].rel_l2, 0);
  const CellDetail f = cell_detail(s, seq, chunk, nullptr, 2, {row("attn.q", 0)});
  EXPECT_EQ(f.first_differing_tensor, -1);
}

TEST(GuiMetrics, TieRuleTensorDetailAndNames) {
  // Relative rule of the diff engine: f × the median (element of rank n/2) of the finite |margin|.
  EXPECT_DOUBLE_EQ(single_trace_tie_threshold({1, 3, INFINITY, 2}, tie_factor("train")), 2.0 / 128);
  EXPECT_DOUBLE_EQ(single_trace_tie_threshold({1, 3, 2, 4}, tie_factor("rollout")), 3.0 / 16);
  EXPECT_TRUE(std::isnan(single_trace_tie_threshold({INFINITY}, tie_factor("train"))));

  TensorRowPair p{"moe.out", DType::bf16, 7, {1, 2, 3, 4}, {1, 2.5f, 3, 3}};
  const TensorDetail t = tensor_detail(p);
  EXPECT_EQ(t.elems, 4);
  EXPECT_EQ(t.histogram.zeros, 2);
  int64_t binned = 0;
  for (auto c : t.histogram.counts) binned += c;
  EXPECT_EQ(binned, 2);
  EXPECT_DOUBLE_EQ(t.max_abs, 1.0);
  ASSERT_EQ(t.worst.size(), 2u);
  EXPECT_EQ(t.worst[0].index, 3);
  EXPECT_EQ(t.worst[1].index, 1);
  EXPECT_NEAR(t.rel_l2, std::sqrt(1.25 / 30), 1e-12);

  for (const auto& m : all_metrics()) EXPECT_EQ(metric_from_name(m.name), m.metric);
  try {
    metric_from_name("entropy");
    FAIL() << "no exception";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("indexer-overlap"), std::string::npos) << e.what();
  }
}

// ---- the loader and the models on recorded traces --------------------------------------------

class GuiModels : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { (void)gui_traces(); }
};

TEST_F(GuiModels, PairLoadsInStagesAndEveryModelPassesTheTester) {
  TesterGuard guard;
  TraceDocument doc;
  HeatmapModel heat(&doc);
  TokenModel tokens(&doc);
  SummaryModel summary(&doc);
  LayerDiffModel layers(&doc);
  TensorDiffModel tensors(&doc);
  EnvModel env(&doc);
  std::vector<std::unique_ptr<QAbstractItemModelTester>> testers;
  for (QAbstractItemModel* m :
       std::initializer_list<QAbstractItemModel*>{&heat, &tokens, &summary, &layers, &tensors, &env})
    testers.push_back(tester(m));

  std::vector<std::string> order;
  QObject::connect(&doc, &TraceDocument::datasetReset, [&] { order.push_back("summary"); });
  QObject::connect(&doc, &TraceDocument::seqLoaded, [&](int) { order.push_back("seq"); });
  QObject::connect(&doc, &TraceDocument::chunkLoaded, [&](int, int) { order.push_back("chunk"); });
  QObject::connect(&doc, &TraceDocument::reportLoaded, [&] { order.push_back("report"); });
  const auto r = load(doc, gui_traces().a, gui_traces().b);
  ASSERT_TRUE(r.finished) << r.error.message.toStdString();

  const int L = doc.data().layers();
  ASSERT_EQ(L, 6);
  std::vector<std::string> expected{"summary", "seq"};
  for (int l = 0; l < L; ++l) expected.push_back("chunk");
  expected.push_back("report");
  EXPECT_EQ(order, expected);
  EXPECT_TRUE(doc.data().comparison());
  EXPECT_EQ(heat.rowCount(), L);
  EXPECT_EQ(heat.columnCount(), gui_traces().tokens);
  EXPECT_EQ(tokens.rowCount(), gui_traces().tokens - 1);
  EXPECT_EQ(layers.rowCount(), L);
  EXPECT_GT(tensors.rowCount(), 0);
  EXPECT_GT(summary.rowCount(), 10);
  EXPECT_GT(env.rowCount(), 10);

  // Every comparison metric, with and without the threshold highlight.
  for (Metric m : heat.availableMetrics()) {
    heat.setMetric(m);
    EXPECT_EQ(heat.metric(), m);
    heat.setThresholdEnabled(true);
    heat.setThreshold(metric_info(m).default_threshold);
    heat.setThresholdEnabled(false);
  }
  const auto avail = heat.availableMetrics();
  EXPECT_EQ(std::count(avail.begin(), avail.end(), Metric::ExpertLoad), 0);
  guard.expect_clean();
}

TEST_F(GuiModels, HeatmapValuesMatchTheReader) {
  TraceDocument doc;
  HeatmapModel heat(&doc);
  ASSERT_TRUE(load(doc, gui_traces().a, gui_traces().b).finished);
  const TraceReader ra = TraceReader::open(gui_traces().a), rb = TraceReader::open(gui_traces().b);
  const int64_t T = gui_traces().tokens;
  const DigestTable da = ra.digests(0, 0), db = rb.digests(0, 0);
  int indexer_layers = 0, tensor_layers = 0, named_tokens = 0;
  for (int layer = 0; layer < 6; ++layer) {
    const auto ia = ra.indexer(0, 0, layer), ib = rb.indexer(0, 0, layer);
    const auto ga = ra.routing(0, 0, layer), gb = rb.routing(0, 0, layer);
    heat.setMetric(Metric::IndexerOverlap);
    for (int64_t t = 0; t < T; ++t) {
      const double v = heat_value(heat, layer, int(t));
      if (!ia || !ib) {
        EXPECT_TRUE(std::isnan(v));
        continue;
      }
      const int64_t w = int64_t(ia->ids.size()) / T;
      const auto sa = row_set(ia->ids, w, t), sb = row_set(ib->ids, w, t);
      const double expect =
          sa.empty() && sb.empty() ? 1.0 : double(common(sa, sb)) / std::max<size_t>(sa.size(), 1);
      EXPECT_NEAR(v, expect, 1e-6) << "layer " << layer << " token " << t;
    }
    indexer_layers += ia.has_value();

    heat.setMetric(Metric::RoutingAgreement);
    ASSERT_TRUE(ga && gb);
    for (int64_t t = 0; t < T; ++t) {
      const auto sa = row_set(ga->ids, ga->k, t), sb = row_set(gb->ids, gb->k, t);
      const size_t inter = common(sa, sb), uni = sa.size() + sb.size() - inter;
      EXPECT_NEAR(heat_value(heat, layer, int(t)), uni ? double(inter) / uni : 1.0, 1e-6);
    }

    heat.setMetric(Metric::MhcDifference);
    std::vector<double> mhc(T, 0.0);
    for (Sublayer s : {Sublayer::attn, Sublayer::ffn}) {
      const auto ma = ra.mhc(0, 0, layer, s), mb = rb.mhc(0, 0, layer, s);
      ASSERT_TRUE(ma && mb);
      const int hc = ma->hc;
      for (int64_t t = 0; t < T; ++t) {
        for (int j = 0; j < hc; ++j) {
          mhc[t] = std::max(mhc[t], double(std::fabs(ma->pre[t * hc + j] - mb->pre[t * hc + j])));
          mhc[t] = std::max(mhc[t], double(std::fabs(ma->post[t * hc + j] - mb->post[t * hc + j])));
        }
        for (int j = 0; j < hc * hc; ++j)
          mhc[t] = std::max(mhc[t], double(std::fabs(ma->comb[t * hc * hc + j] - mb->comb[t * hc * hc + j])));
      }
    }
    for (int64_t t = 0; t < T; ++t) EXPECT_NEAR(heat_value(heat, layer, int(t)), mhc[t], 1e-7);

    heat.setMetric(Metric::TensorDigest);
    std::map<std::string, const DigestRecord*> bi;
    for (const auto& r : db.records)
      if (r.layer == layer) bi[r.name] = &r;
    for (int64_t t = 0; t < T; ++t) {
      int n = 0, differ = 0;
      for (const auto& r : da.records) {
        if (r.layer != layer || r.rows != T || !bi.count(r.name)) continue;
        ++n;
        differ += da.values[r.first + t] != db.values[bi[r.name]->first + t];
      }
      EXPECT_NEAR(heat_value(heat, layer, int(t)), double(differ) / n, 1e-6);
    }

    heat.setMetric(Metric::TensorRelL2);
    std::vector<double> rel(T, NAN), runner_up(T, -1);
    std::vector<std::string> largest(T);
    for (const auto& [name, l] : ra.full_tensors(0, 0)) {
      if (l != layer) continue;
      const auto ta = ra.tensor(0, 0, layer, name), tb = rb.tensor(0, 0, layer, name);
      ASSERT_TRUE(ta && tb);
      const int64_t n = int64_t(ta->f.size()) / T;
      for (int64_t t = 0; t < T; ++t) {
        double num = 0, den = 0;
        for (int64_t j = 0; j < n; ++j) {
          const double x = ta->f[t * n + j], y = tb->f[t * n + j];
          num += (x - y) * (x - y);
          den += x * x;
        }
        const double v = num == 0 ? 0 : std::sqrt(num / den);
        if (std::isnan(rel[t]) || v > rel[t]) {
          runner_up[t] = std::isnan(rel[t]) ? -1 : rel[t];
          rel[t] = v;
          largest[t] = name;
        } else {
          runner_up[t] = std::max(runner_up[t], v);
        }
      }
      ++tensor_layers;
    }
    for (int64_t t = 0; t < T; ++t) {
      const double v = heat_value(heat, layer, int(t));
      if (std::isnan(rel[t])) {
        EXPECT_TRUE(std::isnan(v));
      } else {
        EXPECT_NEAR(v, rel[t], 1e-5 * std::max(1.0, rel[t]));
        // The tooltip names the tensor the value comes from, where it is the clear maximum.
        if (rel[t] > 0 && runner_up[t] < rel[t] * (1 - 1e-4)) {
          ++named_tokens;
          EXPECT_TRUE(
              heat.cellToolTip(layer, int(t)).contains(QStringLiteral(" in %1  [").arg(largest[t].c_str())))
              << heat.cellToolTip(layer, int(t)).toStdString() << "\nexpected " << largest[t];
        }
      }
    }

    heat.setMetric(Metric::RouterMargin);
    for (int64_t t = 0; t < T; ++t) {
      const double expect = std::min(ga->margin[t], gb->margin[t]);
      const double v = heat_value(heat, layer, int(t));
      if (std::isinf(expect)) {
        EXPECT_TRUE(std::isinf(v));
      } else {
        EXPECT_FLOAT_EQ(float(v), float(expect));
      }
    }
  }
  EXPECT_EQ(indexer_layers, 2);
  EXPECT_GT(named_tokens, 100);
  EXPECT_EQ(tensor_layers, 2);  // attn.o at layer 1, moe.out at layer 3
}

TEST_F(GuiModels, TablesMatchTheReaderAndTheDiffEngine) {
  TraceDocument doc;
  TokenModel tokens(&doc);
  LayerDiffModel layers(&doc);
  TensorDiffModel tensors(&doc);
  SummaryModel summary(&doc);
  EnvModel env(&doc);
  ASSERT_TRUE(load(doc, gui_traces().a, gui_traces().b).finished);
  const TraceReader ra = TraceReader::open(gui_traces().a), rb = TraceReader::open(gui_traces().b);
  const auto la = ra.logprobs(0, 0), lb = rb.logprobs(0, 0);
  const auto tok = ra.tokens(0, 0);
  ASSERT_EQ(tokens.rowCount(), int(la.size()));
  for (int t = 0; t < tokens.rowCount(); ++t) {
    EXPECT_EQ(tokens.data(tokens.index(t, TokenModel::NextToken)).toInt(), tok[t + 1]);
    EXPECT_FLOAT_EQ(float(tokens.data(tokens.index(t, TokenModel::LogprobA)).toDouble()), la[t]);
    EXPECT_FLOAT_EQ(float(tokens.data(tokens.index(t, TokenModel::LogprobB)).toDouble()), lb[t]);
    EXPECT_NEAR(tokens.data(tokens.index(t, TokenModel::AbsDiff)).toDouble(),
                std::fabs(double(la[t]) - lb[t]), 1e-6);
  }

  const DiffReport rep = diff_traces(gui_traces().a, gui_traces().b, DiffOptions{});
  ASSERT_EQ(layers.rowCount(), int(rep.layers.size()));
  for (int i = 0; i < layers.rowCount(); ++i) {
    EXPECT_EQ(layers.data(layers.index(i, 0)).toInt(), rep.layers[i].layer);
    EXPECT_DOUBLE_EQ(layers.data(layers.index(i, 5)).toDouble(), rep.layers[i].routing_exact);
    EXPECT_DOUBLE_EQ(layers.data(layers.index(i, 8)).toDouble(), rep.layers[i].mhc_comb_max_abs);
  }
  ASSERT_EQ(tensors.rowCount(), int(rep.tensors.size()));
  for (int i = 0; i < tensors.rowCount(); ++i) {
    EXPECT_EQ(tensors.data(tensors.index(i, 0)).toString().toStdString(), rep.tensors[i].name);
    EXPECT_EQ(tensors.data(tensors.index(i, 3)).toString(),
              QStringLiteral("%1 / %2").arg(rep.tensors[i].rows_differing).arg(rep.tensors[i].rows));
  }
  ASSERT_TRUE(rep.first_divergence);
  EXPECT_EQ(summary.value(QStringLiteral("first divergence")),
            QStringLiteral("seq %1, layer %2, %3, row %4")
                .arg(rep.first_divergence->seq)
                .arg(rep.first_divergence->layer)
                .arg(QString::fromStdString(rep.first_divergence->tensor))
                .arg(rep.first_divergence->row));
  EXPECT_EQ(summary.value(QStringLiteral("KL k3")), QString::number(rep.k3, 'g', 6));

  // The environments side by side: every key of both, flagged where they differ.
  const auto ea = ra.env(), eb = rb.env();
  int differing = 0;
  for (const auto& [k, v] : ea) {
    bool found = false;
    for (int r = 0; r < env.rowCount(); ++r) {
      if (env.data(env.index(r, 0)).toString().toStdString() != k) continue;
      found = true;
      EXPECT_EQ(env.data(env.index(r, 1)).toString().toStdString(), v);
      const bool differs = !eb.count(k) || eb.at(k) != v;
      EXPECT_EQ(env.data(env.index(r, 0), EnvModel::DiffersRole).toBool(), differs) << k;
      differing += differs;
    }
    EXPECT_TRUE(found) << k;
  }
  // The step profiles always differ in this pair (train vs rollout).
  EXPECT_GE(env.differingRows(), differing + 1);
}

TEST_F(GuiModels, SingleTraceMarginsNearTiesAndExpertLoad) {
  TesterGuard guard;
  TraceDocument doc;
  HeatmapModel heat(&doc);
  TokenModel tokens(&doc);
  SummaryModel summary(&doc);
  EnvModel env(&doc);
  LayerDiffModel layers(&doc);
  auto t1 = tester(&heat), t2 = tester(&tokens), t3 = tester(&summary), t4 = tester(&env),
       t5 = tester(&layers);
  ASSERT_TRUE(load(doc, gui_traces().a).finished);
  EXPECT_EQ(tokens.columnCount(), 3);
  EXPECT_EQ(env.columnCount(), 2);
  EXPECT_EQ(env.differingRows(), 0);
  EXPECT_EQ(layers.rowCount(), 0);
  EXPECT_EQ(summary.value(QStringLiteral("tokens")), QString::number(gui_traces().tokens));
  // The file's seal as `trace info` words it (the samples predate seals: "none ...").
  EXPECT_EQ(summary.value(QStringLiteral("seal")),
            QString::fromStdString(seal_summary(check_seal(gui_traces().a))));
  EXPECT_FALSE(summary.value(QStringLiteral("seal")).isEmpty());
  EXPECT_FALSE(doc.data().comparison());
  EXPECT_EQ(heat.metric(), Metric::RouterMargin);
  const auto avail = heat.availableMetrics();
  EXPECT_EQ(avail, (std::vector<Metric>{Metric::IndexerMargin, Metric::RouterMargin, Metric::ExpertLoad}));
  const TraceReader ra = TraceReader::open(gui_traces().a);
  const ModelConfig cfg = ra.config();
  int near_ties = 0;
  for (int layer = 0; layer < 6; ++layer) {
    const auto g = ra.routing(0, 0, layer);
    ASSERT_TRUE(g);
    // The near-tie rule computed here: 2^-7 (train profile) × median of the finite |margins|.
    std::vector<double> m;
    for (float x : g->margin)
      if (std::isfinite(x)) m.push_back(std::fabs(x));
    double thr = NAN;
    if (!m.empty()) {
      std::sort(m.begin(), m.end());
      const double med = m.size() % 2 ? m[m.size() / 2] : 0.5 * (m[m.size() / 2 - 1] + m[m.size() / 2]);
      thr = med / 128;
    }
    heat.setMetric(Metric::RouterMargin);
    for (int t = 0; t < gui_traces().tokens; ++t) {
      const bool tie = !std::isnan(thr) && g->margin[t] < thr;
      EXPECT_EQ(heat.data(heat.index(layer, t), HeatmapModel::NearTieRole).toBool(), tie)
          << layer << " " << t;
      near_ties += tie;
    }
    heat.setMetric(Metric::ExpertLoad);
    ASSERT_EQ(heat.columnCount(), cfg.n_routed_experts);
    std::vector<int> counts(cfg.n_routed_experts, 0);
    for (int32_t id : g->ids) counts[id]++;
    for (int e = 0; e < cfg.n_routed_experts; ++e)
      EXPECT_EQ(heat.data(heat.index(layer, e), HeatmapModel::ValueRole).toInt(), counts[e]);
  }
  EXPECT_GT(near_ties, 0);
  // Threshold: load above 40 tokens highlighted.
  heat.setThreshold(40);
  heat.setThresholdEnabled(true);
  for (int e = 0; e < cfg.n_routed_experts; ++e)
    EXPECT_EQ(heat.data(heat.index(4, e), HeatmapModel::BeyondThresholdRole).toBool(),
              heat.data(heat.index(4, e), HeatmapModel::ValueRole).toDouble() > 40);
  guard.expect_clean();
}

TEST_F(GuiModels, DetailOfACellMatchesTheReader) {
  TesterGuard guard;
  TraceDocument doc;
  ASSERT_TRUE(load(doc, gui_traces().a, gui_traces().b).finished);
  const TraceReader ra = TraceReader::open(gui_traces().a), rb = TraceReader::open(gui_traces().b);
  const int layer = 3;  // C4, learned routing, moe.out captured in full
  const auto ia = ra.indexer(0, 0, layer), ib = rb.indexer(0, 0, layer);
  ASSERT_TRUE(ia && ib);
  const int64_t T = gui_traces().tokens;
  const int64_t w = int64_t(ia->ids.size()) / T;
  int64_t token = -1;
  for (int64_t t = T - 1; t >= 0 && token < 0; --t)
    if (row_set(ia->ids, w, t) != row_set(ib->ids, w, t)) token = t;
  ASSERT_GE(token, 0) << "no differing indexer row at layer 3";

  std::vector<DetailPtr> got;
  QObject::connect(&doc, &TraceDocument::detailReady, [&](DetailPtr d) { got.push_back(d); });
  // Three requests in a row: the two older ones are superseded.
  ASSERT_TRUE(doc.requestDetail(0, layer, 0));
  ASSERT_TRUE(doc.requestDetail(0, layer, 1));
  ASSERT_TRUE(doc.requestDetail(0, layer, token));
  EXPECT_FALSE(doc.requestDetail(0, 99, 0));
  ASSERT_TRUE(wait_until([&] { return !got.empty(); }));
  wait_until([] { return false; }, 200);
  ASSERT_EQ(got.size(), 1u);
  const CellDetail& d = *got[0];
  EXPECT_EQ(d.token, token);
  const auto sa = row_set(ia->ids, w, token), sb = row_set(ib->ids, w, token);
  EXPECT_EQ(std::set<int32_t>(d.indexer_a.begin(), d.indexer_a.end()), sa);
  EXPECT_EQ(std::set<int32_t>(d.indexer_b.begin(), d.indexer_b.end()), sb);
  EXPECT_EQ(d.indexer_common.size(), common(sa, sb));
  EXPECT_EQ(d.indexer_only_a.size(), sa.size() - common(sa, sb));
  EXPECT_EQ(d.indexer_only_b.size(), sb.size() - common(sa, sb));
  EXPECT_TRUE(d.indexer_differs);
  const LayerDiff* ld = doc.data().layer_diff(layer);
  ASSERT_NE(ld, nullptr);
  EXPECT_EQ(d.indexer_tie_threshold, ld->indexer_tie_threshold);
  EXPECT_EQ(d.indexer_tie_flip,
            ia->margin[token] < ld->indexer_tie_threshold || ib->margin[token] < ld->indexer_tie_threshold);
  EXPECT_FLOAT_EQ(d.indexer_margin_a, ia->margin[token]);

  const auto ga = ra.routing(0, 0, layer), gb = rb.routing(0, 0, layer);
  std::map<int, std::pair<float, float>> experts;
  for (int j = 0; j < ga->k; ++j) experts[ga->ids[token * ga->k + j]].first = ga->weights[token * ga->k + j];
  for (int j = 0; j < gb->k; ++j) experts[gb->ids[token * gb->k + j]].second = gb->weights[token * gb->k + j];
  ASSERT_EQ(d.experts.size(), experts.size());
  for (const auto& e : d.experts) {
    EXPECT_FLOAT_EQ(e.weight_a, experts[e.id].first);
    EXPECT_FLOAT_EQ(e.weight_b, experts[e.id].second);
  }

  const auto ma = ra.mhc(0, 0, layer, Sublayer::ffn), mb = rb.mhc(0, 0, layer, Sublayer::ffn);
  ASSERT_EQ(d.hc, ma->hc);
  for (int j = 0; j < d.hc * d.hc; ++j) {
    EXPECT_EQ(d.comb_a[1][j], ma->comb[token * d.hc * d.hc + j]);
    EXPECT_EQ(d.comb_diff[1][j], mb->comb[token * d.hc * d.hc + j] - ma->comb[token * d.hc * d.hc + j]);
  }

  ASSERT_EQ(d.tensors.size(), 1u);
  const TensorDetail& td = d.tensors[0];
  EXPECT_EQ(td.name, "moe.out");
  EXPECT_EQ(td.row, token);
  const auto ta = ra.tensor(0, 0, layer, "moe.out"), tb = rb.tensor(0, 0, layer, "moe.out");
  const int64_t n = int64_t(ta->f.size()) / T;
  double num = 0, den = 0, mx = 0;
  for (int64_t j = 0; j < n; ++j) {
    const double x = ta->f[token * n + j], y = tb->f[token * n + j];
    num += (y - x) * (y - x), den += x * x, mx = std::max(mx, std::fabs(y - x));
  }
  EXPECT_NEAR(td.rel_l2, std::sqrt(num / den), 1e-9);
  EXPECT_DOUBLE_EQ(td.max_abs, mx);
  ASSERT_FALSE(td.worst.empty());
  EXPECT_DOUBLE_EQ(td.worst[0].abs_diff, mx);
  int64_t binned = td.histogram.zeros + td.histogram.nonfinite;
  for (auto c : td.histogram.counts) binned += c;
  EXPECT_EQ(binned, n);

  // The detail panel's models.
  IndexerSetModel sets;
  ExpertModel exps;
  WorstElementsModel worst;
  auto t1 = tester(&sets), t2 = tester(&exps), t3 = tester(&worst);
  sets.setDetail(got[0]);
  exps.setDetail(got[0]);
  worst.setDetail(got[0], 0);
  EXPECT_EQ(sets.rowCount(),
            int(d.indexer_common.size() + d.indexer_only_a.size() + d.indexer_only_b.size()));
  for (int r = 0; r < sets.rowCount(); ++r) {
    const int g = sets.data(sets.index(r, 0)).toInt();
    const auto side = SetSide(sets.data(sets.index(r, 0), IndexerSetModel::SideRole).toInt());
    EXPECT_EQ(side == SetSide::Common, sa.count(g) && sb.count(g));
    EXPECT_EQ(side == SetSide::OnlyA, sa.count(g) && !sb.count(g));
  }
  EXPECT_EQ(exps.rowCount(), int(experts.size()));
  EXPECT_EQ(worst.rowCount(), int(td.worst.size()));
  worst.setDetail(nullptr, -1);
  EXPECT_EQ(worst.rowCount(), 0);
  guard.expect_clean();
}

TEST_F(GuiModels, NewerLoadsSupersedeAndCancelStops) {
  TraceDocument doc;
  // A load replaced before it finishes: only the newer one's data arrives.
  doc.open(QString::fromStdString(gui_traces().a));
  const auto r = load(doc, gui_traces().a, gui_traces().b);
  ASSERT_TRUE(r.finished);
  EXPECT_TRUE(doc.data().comparison());
  EXPECT_EQ(doc.data().summary->b->path, gui_traces().b);

  // Cancelling: the canceled signal comes and no load finishes afterwards.
  bool finished = false, canceled = false;
  QObject::connect(&doc, &TraceDocument::loadFinished, [&] { finished = true; });
  QObject::connect(&doc, &TraceDocument::loadCanceled, [&] { canceled = true; });
  doc.open(QString::fromStdString(gui_traces().a));
  doc.cancel();
  ASSERT_TRUE(wait_until([&] { return canceled; }, 10000));
  wait_until([] { return false; }, 300);
  EXPECT_FALSE(finished);
  EXPECT_FALSE(doc.loading());
}

TEST_F(GuiModels, BadFilesFailWithTypedErrorsNamingTheFile) {
  const std::string dir = dsv4::test::temp_dir("bad_files");
  TraceDocument doc;
  const std::string text = dsv4::test::write_not_a_trace(dir);
  auto r = load(doc, text);
  ASSERT_TRUE(r.failed);
  EXPECT_EQ(r.error.kind, LoadErrorKind::NotATrace);
  EXPECT_TRUE(r.error.message.contains(QStringLiteral("notes.h5"))) << r.error.message.toStdString();

  r = load(doc, dsv4::test::write_with_version(gui_traces().a, dir, 999));
  ASSERT_TRUE(r.failed);
  EXPECT_EQ(r.error.kind, LoadErrorKind::UnsupportedVersion);
  EXPECT_TRUE(r.error.message.contains(QStringLiteral("999"))) << r.error.message.toStdString();

  r = load(doc, dsv4::test::write_truncated(gui_traces().a, dir));
  ASSERT_TRUE(r.failed);
  EXPECT_TRUE(r.error.message.contains(QStringLiteral("truncated.h5"))) << r.error.message.toStdString();
  if (r.error.kind == LoadErrorKind::Corrupt) {
    // A damaged file: the command that recovers it, HDF5's error stack only in the details.
    EXPECT_TRUE(r.error.message.contains(QStringLiteral("dsv4 trace salvage")))
        << r.error.message.toStdString();
    EXPECT_FALSE(r.error.message.contains(QStringLiteral("(HDF5: "))) << r.error.message.toStdString();
    EXPECT_TRUE(r.error.details.size() >= r.error.message.section('\n', 0, 0).size());
  }
  EXPECT_FALSE(r.error.pair);
  EXPECT_FALSE(doc.data().summary);

  r = load(doc, dir + "/missing.h5");
  ASSERT_TRUE(r.failed);
  EXPECT_TRUE(r.error.message.contains(QStringLiteral("missing.h5"))) << r.error.message.toStdString();

  // A step that does not exist.
  r = load(doc, gui_traces().a, {}, 5);
  ASSERT_TRUE(r.failed);
  EXPECT_TRUE(r.error.message.contains(QStringLiteral("step 5"))) << r.error.message.toStdString();
  fs::remove_all(dir);
}

TEST_F(GuiModels, ReloadSeesStepsAppendedToTheTrace) {
  const std::string dir = dsv4::test::temp_dir("reload");
  const std::string path = dir + "/growing.h5";
  fs::copy_file(gui_traces().a, path);
  TraceDocument doc;
  ASSERT_TRUE(load(doc, path).finished);
  EXPECT_EQ(doc.data().summary->a.steps.size(), 1u);
  // Another process appends a step while the viewer holds the file open.
  const auto rec = dsv4::test::run_cli(
      "record --preset tiny --seed 7 --random 24 --profile rollout --append --out " + path);
  ASSERT_EQ(rec.code, 0) << rec.out;
  bool finished = false;
  QObject::connect(&doc, &TraceDocument::loadFinished, [&] { finished = true; });
  doc.reload();
  ASSERT_TRUE(wait_until([&] { return finished; }));
  ASSERT_EQ(doc.data().summary->a.steps.size(), 2u);
  EXPECT_TRUE(doc.data().summary->a.steps[1].complete);
  // The new step can be shown.
  const auto r = load(doc, path, {}, 1);
  ASSERT_TRUE(r.finished) << r.error.message.toStdString();
  EXPECT_EQ(doc.data().tokens(0), 24);
  // Comparing steps of different lengths is refused with a sentence naming both lengths.
  const auto m = load(doc, path, path, 0, 1);
  ASSERT_TRUE(m.failed);
  EXPECT_EQ(m.error.kind, LoadErrorKind::Mismatch);
  EXPECT_TRUE(m.error.pair);
  const QString lengths = QStringLiteral("lengths [%1]").arg(gui_traces().tokens);
  EXPECT_TRUE(m.error.message.contains(lengths)) << m.error.message.toStdString();
  EXPECT_TRUE(m.error.message.contains(QStringLiteral("lengths [24]"))) << m.error.message.toStdString();
  // It failed before its summary: the complete dataset shown before stays.
  ASSERT_TRUE(doc.data().summary);
  EXPECT_TRUE(doc.data().complete);
  EXPECT_FALSE(doc.data().comparison());
  fs::remove_all(dir);
}

// Following: an unchanged trace never asks for a reload; a step appended by another process, and a
// recording renamed from NAME.h5.incomplete to NAME.h5 at its close, each do, and the reload shows them.
TEST_F(GuiModels, FollowingARecordingReloadsWhenTheFilesChange) {
  const std::string dir = dsv4::test::temp_dir("follow");
  const std::string done = dir + "/live.h5", live = done + ".incomplete";
  fs::copy_file(gui_traces().a, live);
  TraceDocument doc;
  ASSERT_TRUE(load(doc, live).finished);
  int changes = 0;
  QObject::connect(&doc, &TraceDocument::filesChanged, [&] {
    ++changes;
    doc.reload();
  });
  doc.setFollow(true, 20);
  EXPECT_TRUE(doc.follow());
  EXPECT_FALSE(wait_until([&] { return changes > 0; }, 300));  // nothing changed
  // The recorder finishes: renames the file, then appends a step to it.
  fs::rename(live, done);
  ASSERT_TRUE(
      wait_until([&] { return changes >= 1 && !doc.loading() && doc.lastRequest().path_a == done.c_str(); }));
  const int before = changes;
  const auto rec = dsv4::test::run_cli(
      "record --preset tiny --seed 7 --random 24 --profile rollout --append --out " + done);
  ASSERT_EQ(rec.code, 0) << rec.out;
  std::string failures;
  QObject::connect(&doc, &TraceDocument::loadFailed,
                   [&](const LoadError& e) { failures += e.message.toStdString() + "\n"; });
  ASSERT_TRUE(wait_until(
      [&] {
        return changes > before && !doc.loading() && doc.data().summary &&
               doc.data().summary->a.steps.size() == 2u;
      },
      20000))
      << "changes " << changes << " before " << before << " loading " << doc.loading() << " summary "
      << bool(doc.data().summary) << " steps "
      << (doc.data().summary ? doc.data().summary->a.steps.size() : 0) << " path "
      << doc.lastRequest().path_a.toStdString() << "\n"
      << failures;
  EXPECT_EQ(doc.data().summary->a.path, done);
  doc.setFollow(false);
  EXPECT_FALSE(doc.follow());
  fs::remove_all(dir);
}

// A recording opened while it is NAME.h5.incomplete: once the recorder closes it (renames it to
// NAME.h5), reload reads the finished file under its new name.
TEST_F(GuiModels, ReloadFollowsAFinishedRecordingToItsFinalName) {
  const std::string dir = dsv4::test::temp_dir("live-rename");
  const std::string done = dir + "/live.h5", live = done + ".incomplete";
  fs::copy_file(gui_traces().a, live);
  TraceDocument doc;
  const auto first = load(doc, live);
  ASSERT_TRUE(first.finished) << first.error.message.toStdString();
  EXPECT_EQ(doc.data().summary->a.path, live);
  int renamed = 0;
  QObject::connect(&doc, &TraceDocument::pathsChanged, [&] { ++renamed; });
  fs::rename(live, done);
  bool finished = false, failed = false;
  QObject::connect(&doc, &TraceDocument::loadFinished, [&] { finished = true; });
  QObject::connect(&doc, &TraceDocument::loadFailed, [&](const LoadError& e) {
    failed = true;
    ADD_FAILURE() << e.message.toStdString();
  });
  doc.reload();
  ASSERT_TRUE(wait_until([&] { return finished || failed; }));
  ASSERT_TRUE(finished);
  EXPECT_EQ(renamed, 1);
  EXPECT_EQ(doc.lastRequest().path_a, QString::fromStdString(done));
  EXPECT_EQ(doc.data().summary->a.path, done);
  EXPECT_EQ(doc.data().tokens(0), gui_traces().tokens);
  // Reloading again keeps the final name (nothing to follow).
  finished = false;
  doc.reload();
  ASSERT_TRUE(wait_until([&] { return finished || failed; }));
  EXPECT_EQ(renamed, 1);
  EXPECT_EQ(doc.data().summary->a.path, done);
  fs::remove_all(dir);
}

// A one-step trace of the tiny preset whose step holds the given GPU kernel records.
std::string trace_with_kernels(const std::string& path, const KernelRecords& k) {
  test::write_trace_with_kernels(path, test::tiny(), random_tokens(20, 512, 5), {k});
  return path;
}

// Launches of 2.5 us each, one after the other, with the given names and grid x.
KernelRecords kernel_list(std::initializer_list<std::pair<const char*, int>> launches) {
  std::vector<test::Launch> ls;
  for (const auto& [name, grid] : launches)
    ls.push_back({name, {grid, 1, 1}, 1024, 40, 1000 * int64_t(ls.size()), 2500});
  return test::kernel_records(ls);
}

TEST_F(GuiModels, KernelLaunchesSideBySide) {
  TesterGuard guard;
  const std::string dir = test::temp_dir("kernels");
  const std::string a =
      trace_with_kernels(dir + "/a.h5", kernel_list({{"embed", 4}, {"gemm", 64}, {"attn", 8}}));
  const std::string b =
      trace_with_kernels(dir + "/b.h5", kernel_list({{"embed", 4}, {"gemm", 32}, {"attn", 8}, {"tail", 1}}));
  TraceDocument doc;
  KernelModel kernels(&doc);
  auto t = tester(&kernels);

  ASSERT_TRUE(load(doc, a).finished);
  EXPECT_EQ(kernels.columnCount(), 5);
  ASSERT_EQ(kernels.rowCount(), 3);
  EXPECT_EQ(kernels.launches(), 3);
  EXPECT_EQ(kernels.data(kernels.index(1, 1)).toString(), QStringLiteral("gemm"));
  EXPECT_EQ(kernels.data(kernels.index(1, 2)).toString(),
            QStringLiteral("grid (64,1,1) block (256,1,1) smem 1024"));
  EXPECT_EQ(kernels.data(kernels.index(1, 4)).toString(), QStringLiteral("2.5"));
  EXPECT_EQ(kernels.firstDifference(), -1);

  ASSERT_TRUE(load(doc, a, b).finished);
  EXPECT_EQ(kernels.columnCount(), 7);
  ASSERT_EQ(kernels.rowCount(), 4);
  EXPECT_EQ(kernels.firstDifference(), 1);                    // gemm's grid
  const std::vector<bool> differs{false, true, false, true};  // row 3: only B launched it
  for (int r = 0; r < 4; ++r)
    EXPECT_EQ(kernels.data(kernels.index(r, 0), KernelModel::DiffersRole).toBool(), differs[size_t(r)]) << r;
  EXPECT_EQ(kernels.data(kernels.index(3, 1)).toString(), QStringLiteral("(none)"));
  EXPECT_EQ(kernels.data(kernels.index(3, 4)).toString(), QStringLiteral("tail"));

  // A CPU recording carries no records: one row says why.
  KernelRecords none;
  none.reason = "recorded on the cpu";
  const std::string c = trace_with_kernels(dir + "/c.h5", none);
  ASSERT_TRUE(load(doc, c).finished);
  ASSERT_EQ(kernels.rowCount(), 1);
  EXPECT_EQ(kernels.data(kernels.index(0, 1)).toString(),
            QStringLiteral("no kernel records: recorded on the cpu"));
  ASSERT_TRUE(load(doc, c, a).finished);
  ASSERT_EQ(kernels.rowCount(), 1);
  EXPECT_EQ(kernels.data(kernels.index(0, 1)).toString(),
            QStringLiteral("not compared: A recorded on the cpu, B has records"));
  EXPECT_EQ(kernels.firstDifference(), -1);
  guard.expect_clean();
  fs::remove_all(dir);
}

// ---- the divergence navigator ------------------------------------------------------------------

// A pair of two sequences (100 and 50 tokens, 4 layers) with planted flips, per-layer thresholds,
// differing tensors and log-prob differences, shown through TraceDocument::adopt.
// The metric a comparison opens on: where the mHC difference marks a minority of cells it stays; a
// wall of differences gives way to the decision that flipped (routing before indexer), and to nothing
// else when no decision flipped.
TEST(GuiMetrics, DefaultComparisonMetricFollowsWhatDiffers) {
  auto summary = std::make_shared<LoadSummary>();
  summary->a.config = preset("tiny");
  summary->a.config.num_hidden_layers = 2;
  summary->b = summary->a;
  summary->layers = 2;
  summary->seq_lengths = {10};
  auto make = [&](int differing_cells, std::vector<DecisionFlip> flips) {
    Dataset d;
    d.summary = summary;
    d.chunks.assign(1, std::vector<ChunkPtr>(2));
    for (int l = 0; l < 2; ++l) {
      auto c = std::make_shared<LayerChunk>();
      c->layer = l;
      c->values[int(Metric::MhcDifference)].assign(10, 0.0f);
      for (int t = 0; t < 10; ++t)
        if (l * 10 + t < differing_cells) c->values[int(Metric::MhcDifference)][size_t(t)] = 1e-7f;
      c->values[int(Metric::MhcDifference)][9] = kNoValue;  // a cell without data counts for nothing
      if (l == 1) c->flips = flips;
      d.chunks[0][size_t(l)] = c;
    }
    return d;
  };
  const DecisionFlip routing{3, DecisionKind::Routing, 0.5f, 0.6f},
      indexer{4, DecisionKind::Indexer, 0.1f, 0.2f};
  EXPECT_EQ(default_comparison_metric(make(8, {routing}), 0), Metric::MhcDifference);  // 8 of 18: a minority
  EXPECT_EQ(default_comparison_metric(make(9, {routing, indexer}), 0), Metric::RoutingAgreement);  // half
  EXPECT_EQ(default_comparison_metric(make(20, {indexer}), 0), Metric::IndexerOverlap);
  EXPECT_EQ(default_comparison_metric(make(20, {}), 0), Metric::MhcDifference);
  // No mHC cell (nothing loaded, or a side is an external step, which holds decisions only).
  EXPECT_EQ(default_comparison_metric(Dataset{}, 0), Metric::RoutingAgreement);
}

Dataset navigator_dataset() {
  auto summary = std::make_shared<LoadSummary>();
  summary->a.config = preset("tiny");
  summary->a.config.num_hidden_layers = 4;
  summary->a.config.compress_ratios.assign(4, 4);
  summary->b = summary->a;
  summary->layers = 4;
  summary->seq_lengths = {100, 50};
  Dataset d;
  d.summary = summary;
  for (int s = 0; s < 2; ++s) {
    auto seq = std::make_shared<SeqTokens>();
    seq->seq = s;
    seq->T = summary->seq_lengths[size_t(s)];
    d.seqs.push_back(seq);
  }
  d.chunks.assign(2, std::vector<ChunkPtr>(4));
  auto chunk = [&](int s, int l, std::vector<DecisionFlip> flips) {
    auto c = std::make_shared<LayerChunk>();
    c->seq = s;
    c->layer = l;
    c->flips = std::move(flips);
    d.chunks[size_t(s)][size_t(l)] = c;
  };
  for (int s = 0; s < 2; ++s)
    for (int l = 0; l < 4; ++l) chunk(s, l, {});
  // Thresholds: indexer 0.01, routing 0.1 in every layer.
  chunk(0, 1, {{5, DecisionKind::Indexer, 0.001f, 1.0f}, {7, DecisionKind::Routing, 0.5f, 0.6f}});
  chunk(0, 2, {{3, DecisionKind::Indexer, 2.0f, 3.0f}});
  chunk(1, 1, {{9, DecisionKind::Routing, 0.05f, 1.0f}});
  auto r = std::make_shared<DiffReport>();
  for (int l = 0; l < 4; ++l) {
    LayerDiff L;
    L.layer = l;
    L.indexer_tie_threshold = 0.01;
    L.routing_tie_threshold = 0.1;
    r->layers.push_back(L);
  }
  auto tensor = [](const char* name, int layer, bool full, double rel, int64_t seq, int64_t row) {
    TensorDiff t;
    t.name = name;
    t.layer = layer;
    t.full = full;
    t.rel_l2 = rel;
    t.first_digest_seq = seq;
    t.first_digest_row = row;
    t.rows_differing = 3;
    t.rows = 150;
    return t;
  };
  r->tensors = {tensor("attn.q", 1, false, 0, 0, 4), tensor("attn.o", 1, true, 0.5, 0, 2),
                tensor("moe.out", 2, true, 0.2, 1, 2)};
  r->tensors.push_back(tensor("attn.kv", 3, false, 0, -1, -1));
  r->tensors.back().rows_differing = 0;  // equal: not listed
  auto token = [](int seq, int64_t pos, double diff) {
    TokenDiff t;
    t.seq = seq;
    t.position = pos;
    t.abs_diff = diff;
    return t;
  };
  r->tokens = {token(0, 10, 0.5), token(0, 11, 0.1), token(1, 3, 0.9), token(1, 4, 0)};
  r->first_divergence = DiffReport::First{0, 1, "attn.q", 4};
  d.report = r;
  return d;
}

struct Expected {
  DivergenceKind kind;
  int seq, layer;
  int64_t token;
  std::string what;
};

TEST(GuiNavigator, SeverityOrderFiltersSortAndNextPrevious) {
  TesterGuard guard;
  TraceDocument doc;
  NavigatorModel nav(&doc);
  auto t = tester(&nav);
  int current_signals = 0;
  QObject::connect(&nav, &NavigatorModel::currentChanged, [&](int) { ++current_signals; });
  doc.adopt(navigator_dataset());
  ASSERT_TRUE(doc.data().divergences);

  // Confident flips (the larger margin over the threshold first), tie flips (likewise), the first
  // differing tensor of each layer in execution order, the worst log-prob tokens (zero left out).
  const std::vector<Expected> want{
      {DivergenceKind::ConfidentFlip, 0, 2, 3, "indexer"},  // margin 2 / 0.01 = 200
      {DivergenceKind::ConfidentFlip, 0, 1, 7, "routing"},  // 0.5 / 0.1 = 5
      {DivergenceKind::TieFlip, 1, 1, 9, "routing"},        // 0.05 / 0.1 = 0.5
      {DivergenceKind::TieFlip, 0, 1, 5, "indexer"},        // 0.001 / 0.01 = 0.1
      {DivergenceKind::FirstTensor, 0, 1, 4, "attn.q"},     // attn.o is later in layer 1
      {DivergenceKind::FirstTensor, 1, 2, 2, "moe.out"},
      {DivergenceKind::WorstToken, 1, -1, 3, "log-prob"},
      {DivergenceKind::WorstToken, 0, -1, 10, "log-prob"},
      {DivergenceKind::WorstToken, 0, -1, 11, "log-prob"},
  };
  ASSERT_EQ(nav.rowCount(), int(want.size()));
  for (int i = 0; i < nav.rowCount(); ++i) {
    const Divergence* d = nav.item(i);
    ASSERT_TRUE(d);
    EXPECT_EQ(d->kind, want[size_t(i)].kind) << i;
    EXPECT_EQ(d->seq, want[size_t(i)].seq) << i;
    EXPECT_EQ(d->layer, want[size_t(i)].layer) << i;
    EXPECT_EQ(d->token, want[size_t(i)].token) << i;
    EXPECT_EQ(d->what, want[size_t(i)].what) << i;
    EXPECT_EQ(nav.data(nav.index(i, NavigatorModel::Kind), NavigatorModel::KindRole).toInt(),
              int(want[size_t(i)].kind));
  }
  EXPECT_EQ(nav.item(6)->cell_layer, 3);  // a log-prob token is shown on the last layer
  const DivergenceList& l = *nav.list();
  EXPECT_EQ(l.confident_flips, 2);
  EXPECT_EQ(l.tie_flips, 2);
  EXPECT_EQ(l.indexer_flips, 2);
  EXPECT_EQ(l.routing_flips, 2);
  EXPECT_EQ(l.first_cell, (Cell{0, 1, 4}));
  const QString banner = nav.banner();
  EXPECT_TRUE(banner.contains(QStringLiteral("2 confident, 2 tie"))) << banner.toStdString();
  EXPECT_TRUE(banner.contains(QStringLiteral("attn.q"))) << banner.toStdString();
  EXPECT_TRUE(banner.contains(QStringLiteral("3 (0.9), 10 (0.5), 11 (0.1)"))) << banner.toStdString();

  // Next / previous walk the rows shown and stop at both ends.
  EXPECT_EQ(nav.current(), -1);
  EXPECT_EQ(nav.next(), nav.item(0));
  EXPECT_EQ(nav.next(), nav.item(1));
  EXPECT_EQ(nav.previous(), nav.item(0));
  EXPECT_EQ(nav.previous(), nullptr);
  EXPECT_EQ(nav.current(), 0);
  nav.setCurrent(nav.rowCount() - 1);
  EXPECT_EQ(nav.next(), nullptr);
  EXPECT_EQ(nav.current(), nav.rowCount() - 1);
  EXPECT_GT(current_signals, 0);

  // Filters: by layer (log-prob tokens belong to none), kind, sequence; together.
  nav.setCurrent(3);  // the tie flip at seq 0, layer 1, token 5
  nav.setLayerFilter(1);
  EXPECT_EQ(nav.rowCount(), 4);
  for (int i = 0; i < nav.rowCount(); ++i) EXPECT_EQ(nav.item(i)->layer, 1);
  ASSERT_GE(nav.current(), 0);  // the current item is still shown, and still current
  EXPECT_EQ(nav.item(nav.current())->token, 5);
  nav.setSeqFilter(1);
  ASSERT_EQ(nav.rowCount(), 1);
  EXPECT_EQ(nav.item(0)->token, 9);
  EXPECT_EQ(nav.current(), -1);  // filtered away
  nav.setLayerFilter(-1);
  EXPECT_EQ(nav.rowCount(), 3);  // tie flip, moe.out, token 3
  nav.setSeqFilter(-1);
  nav.setKindFilter(int(DivergenceKind::TieFlip));
  ASSERT_EQ(nav.rowCount(), 2);
  EXPECT_EQ(nav.item(0)->token, 9);
  EXPECT_EQ(nav.next(), nav.item(0));
  EXPECT_EQ(nav.next(), nav.item(1));
  EXPECT_EQ(nav.next(), nullptr);
  nav.setKindFilter(-1);

  // Sorting by a column; equal values keep the severity order; Severity restores it.
  nav.sort(NavigatorModel::Token, Qt::AscendingOrder);
  for (int i = 1; i < nav.rowCount(); ++i) EXPECT_LE(nav.item(i - 1)->token, nav.item(i)->token);
  nav.sort(NavigatorModel::Severity, Qt::DescendingOrder);
  EXPECT_EQ(nav.item(0)->kind, DivergenceKind::WorstToken);
  nav.sort(NavigatorModel::Severity, Qt::AscendingOrder);
  EXPECT_EQ(nav.item(0)->token, 3);
  EXPECT_EQ(nav.data(nav.index(0, NavigatorModel::Severity)).toString(),
            QStringLiteral("margin 200× tie threshold"));
  guard.expect_clean();
}
}  // namespace

namespace dsv4 {
namespace {

// Forwards everything to the writer's observer, but sets the margins of every decision of `layer`
// to 1 and, at the planted tokens, swaps one selected id for an unselected one and gives the row the
// planted margin: a tiny one (a tie flip) or 1 (a confident flip).
class PlantingObserver : public Observer {
 public:
  struct Plant {
    int64_t token;
    float margin;
  };
  PlantingObserver(Observer& inner, int layer, std::vector<Plant> indexer, std::vector<Plant> routing,
                   int64_t id_range)
      : inner_(inner),
        layer_(layer),
        indexer_(std::move(indexer)),
        routing_(std::move(routing)),
        id_range_(id_range) {}
  void on_tensor(const TensorRecord& r) override { inner_.on_tensor(r); }
  void on_mhc(const MhcDecision& d) override { inner_.on_mhc(d); }
  bool wants_tensors() const override { return inner_.wants_tensors(); }
  void on_indexer(const IndexerDecision& d) override {
    if (d.layer != layer_) return inner_.on_indexer(d);
    std::vector<int32_t> ids(d.ids, d.ids + d.T * d.k);
    std::vector<float> margin(size_t(d.T), 1.0f);
    for (const Plant& p : indexer_) plant(ids, d.k, p, (p.token + 1) / 4, margin);
    IndexerDecision e = d;
    e.ids = ids.data();
    e.margin = margin.data();
    inner_.on_indexer(e);
  }
  void on_routing(const RoutingDecision& d) override {
    if (d.layer != layer_) return inner_.on_routing(d);
    std::vector<int32_t> ids(d.ids, d.ids + d.T * d.k);
    std::vector<float> margin(size_t(d.T), 1.0f);
    for (const Plant& p : routing_) plant(ids, d.k, p, id_range_, margin);
    RoutingDecision e = d;
    e.ids = ids.data();
    e.margin = margin.data();
    inner_.on_routing(e);
  }

 private:
  static void plant(std::vector<int32_t>& ids, int k, const Plant& p, int64_t range,
                    std::vector<float>& margin) {
    int32_t* row = ids.data() + p.token * k;
    int32_t unused = 0;
    while (std::find(row, row + k, unused) != row + k) ++unused;
    ASSERT_LT(unused, range) << "no unselected id at token " << p.token;
    row[0] = unused;
    std::sort(row, row + k);
    margin[size_t(p.token)] = p.margin;
  }
  Observer& inner_;
  int layer_;
  std::vector<Plant> indexer_, routing_;
  int64_t id_range_;
};

TEST_F(GuiModels, DiffAndViewerClassifyPlantedFlipsIdentically) {
  const std::string dir = test::temp_dir("planted");
  const Weights& w = test::tiny();
  const int layer = 3;  // C4, learned routing
  const std::vector<int32_t> tokens = random_tokens(64, 512, 3);
  const std::vector<PlantingObserver::Plant> idx{{40, 1e-6f}, {41, 1e-6f}, {50, 1.0f}, {51, 1.0f}};
  const std::vector<PlantingObserver::Plant> rt{{10, 1e-6f}, {11, 1e-6f}, {20, 1.0f}, {21, 1.0f}};
  auto record = [&](const std::string& path, bool planted) {
    auto wr = TraceWriter::create(path, w.config(), make_trace_header(w), TraceWriter::Options{});
    StepSpec spec;
    spec.seqs = {tokens};
    PlantingObserver obs(wr->begin_step(spec), layer, planted ? idx : std::vector<PlantingObserver::Plant>{},
                         planted ? rt : std::vector<PlantingObserver::Plant>{}, w.config().n_routed_experts);
    RunOptions ro;
    ro.observer = &obs;
    wr->end_step(forward(w, spec.seqs, ro));
    wr->close();
    return path;
  };
  const std::string a = record(dir + "/a.h5", false), b = record(dir + "/b.h5", true);

  // The diff: every margin but the planted ties is 1, so the threshold is f × 1 and the tiny
  // margins are ties, the others confident.
  const DiffReport rep = diff_traces(a, b, DiffOptions{});
  const LayerDiff& L = rep.layers.at(layer);
  EXPECT_EQ(L.indexer_tie_flips, 2);
  EXPECT_EQ(L.indexer_confident_flips, 2);
  EXPECT_EQ(L.routing_tie_flips, 2);
  EXPECT_EQ(L.routing_confident_flips, 2);
  EXPECT_DOUBLE_EQ(L.indexer_tie_threshold, tie_factor("train"));

  // The viewer, the same pair: each planted token is a flip of the same kind; an unplanted one none.
  TraceDocument doc;
  ASSERT_TRUE(load(doc, a, b).finished);
  auto detail = [&](TraceDocument& d, int64_t token) {
    DetailPtr got;
    auto c = QObject::connect(&d, &TraceDocument::detailReady, [&](DetailPtr x) { got = x; });
    EXPECT_TRUE(d.requestDetail(0, layer, token));
    EXPECT_TRUE(wait_until([&] { return got != nullptr; }));
    QObject::disconnect(c);
    return got;
  };
  for (const auto& p : idx) {
    const DetailPtr d = detail(doc, p.token);
    ASSERT_TRUE(d);
    EXPECT_TRUE(d->indexer_differs) << p.token;
    EXPECT_EQ(d->indexer_tie_flip, p.margin < 1.0f) << p.token;
  }
  for (const auto& p : rt) {
    const DetailPtr d = detail(doc, p.token);
    ASSERT_TRUE(d);
    EXPECT_TRUE(d->routing_differs) << p.token;
    EXPECT_EQ(d->routing_tie_flip, p.margin < 1.0f) << p.token;
  }
  const DetailPtr same = detail(doc, 30);
  ASSERT_TRUE(same);
  EXPECT_FALSE(same->indexer_differs || same->routing_differs);

  // The navigator lists the same flips with the same labels, confident ones first.
  ASSERT_TRUE(doc.data().divergences);
  std::set<std::pair<std::string, int64_t>> confident, tie;
  bool seen_tie = false;
  for (const gui::Divergence& v : doc.data().divergences->items) {
    if (v.kind != gui::DivergenceKind::ConfidentFlip && v.kind != gui::DivergenceKind::TieFlip) continue;
    EXPECT_EQ(v.layer, layer);
    const bool is_tie = v.kind == gui::DivergenceKind::TieFlip;
    EXPECT_FALSE(seen_tie && !is_tie) << "a confident flip after a tie flip";
    seen_tie |= is_tie;
    (is_tie ? tie : confident).insert({v.what, v.token});
  }
  using Set = std::set<std::pair<std::string, int64_t>>;
  EXPECT_EQ(confident, (Set{{"indexer", 50}, {"indexer", 51}, {"routing", 20}, {"routing", 21}}));
  EXPECT_EQ(tie, (Set{{"indexer", 40}, {"indexer", 41}, {"routing", 10}, {"routing", 11}}));
  EXPECT_EQ(doc.data().divergences->confident_flips, L.indexer_confident_flips + L.routing_confident_flips);
  EXPECT_EQ(doc.data().divergences->tie_flips, L.indexer_tie_flips + L.routing_tie_flips);

  // One trace alone: the viewer's own threshold over B's margins is the diff's.
  TraceDocument single;
  ASSERT_TRUE(load(single, b).finished);
  const DetailPtr d = detail(single, 40);
  ASSERT_TRUE(d);
  EXPECT_DOUBLE_EQ(d->indexer_tie_threshold, L.indexer_tie_threshold);
  EXPECT_DOUBLE_EQ(d->router_tie_threshold, L.routing_tie_threshold);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace dsv4

namespace dsv4::gui {
namespace {

// A generation trace: the summary names each sequence's request and its prompt length, and the
// heatmap marks the first generated position on the token axis (nothing on the layer axis).
TEST(GuiGeneration, RequestsAndThePromptBoundary) {
  const std::string dir = dsv4::test::temp_dir("gui-generation");
  {
    std::ofstream f(dir + "/prompts.jsonl");
    f << "{\"id\": \"first\", \"prompt\": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]}\n"
      << "{\"id\": \"second\", \"prompt\": [1, 2, 3]}\n";
  }
  const std::string trace = dir + "/gen.h5";
  std::filesystem::remove(trace);
  const auto r =
      test::run_cli("generate --preset tiny --seed 7 --prompts " + dir +
                    "/prompts.jsonl --max-new-tokens 9 --quiet --out " + dir + "/s.jsonl --record " + trace);
  ASSERT_EQ(r.code, 0) << r.out;
  TraceDocument doc;
  HeatmapModel heat(&doc);
  ASSERT_TRUE(load(doc, trace).finished);
  const auto& s = doc.data().summary;
  ASSERT_TRUE(s);
  EXPECT_EQ(s->request_ids, (std::vector<std::string>{"first", "second"}));
  EXPECT_EQ(s->prompt_lengths, (std::vector<int64_t>{12, 3}));
  EXPECT_EQ(doc.data().tokens(0), 21);
  heat.setMetric(Metric::RouterMargin);  // a token-axis metric
  ASSERT_TRUE(heat.isTokenAxis());
  EXPECT_EQ(heat.promptBoundary(), 12);
  heat.setSeq(1);
  EXPECT_EQ(heat.promptBoundary(), 3);
}

}  // namespace
}  // namespace dsv4::gui

namespace dsv4::gui {
namespace {

// Independent numbers of gradients concatenated in name order, in long double.
struct GradRef {
  long double sq_a = 0, sq_b = 0, sq_d = 0, dot = 0;
  void add(const std::vector<float>& a, const std::vector<float>& b) {
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      const long double x = a[i], y = b[i];
      sq_a += x * x;
      sq_b += y * y;
      sq_d += (y - x) * (y - x);
      dot += x * y;
    }
  }
  double rel_l2() const { return double(std::sqrt(sq_d) / std::sqrt(sq_a)); }
  double cosine() const { return double(dot / (std::sqrt(sq_a) * std::sqrt(sq_b))); }
};

// Two training steps: the Gradients model is a kind × layer table whose cells are the diff engine's
// (kind, layer) aggregates, checked against rel-L2 and cosine computed here from the full gradients;
// tooltips give rel-L2, cosine and the rows differing; other pairs show no cells.
TEST(GuiGradients, KindByLayerCellsOfTwoTrainingSteps) {
  TesterGuard guard;
  const auto& tp = dsv4::test::gui_training_traces();
  TraceDocument doc;
  GradientDiffModel grads(&doc);
  SummaryModel summary(&doc);
  auto t = tester(&grads);
  const auto r = load(doc, tp.a, tp.b);
  ASSERT_TRUE(r.finished) << r.error.message.toStdString();
  ASSERT_TRUE(grads.available());

  const DiffReport rep = diff_traces(tp.a, tp.b, DiffOptions{});
  ASSERT_TRUE(rep.training.has_value());
  const TrainingDiff& d = *rep.training;
  ASSERT_GT(d.params_differing, 0);
  const int L = doc.data().layers();
  ASSERT_EQ(grads.rowCount(), int(d.kinds.size()));
  ASSERT_EQ(grads.columnCount(), 1 + L);
  EXPECT_EQ(grads.headerData(0, Qt::Horizontal).toString(), QStringLiteral("model"));
  EXPECT_EQ(grads.headerData(4, Qt::Horizontal).toString(), QStringLiteral("3"));
  std::map<std::pair<std::string, int>, const GradAggregate*> want;
  for (const GradAggregate& c : d.cells) want[{c.kind, c.layer}] = &c;
  int cells = 0;
  for (int row = 0; row < grads.rowCount(); ++row) {
    const std::string kind = grads.headerData(row, Qt::Vertical).toString().toStdString();
    EXPECT_EQ(kind, d.kinds[size_t(row)]);
    for (int col = 0; col < grads.columnCount(); ++col) {
      const QModelIndex i = grads.index(row, col);
      const auto it = want.find({kind, col - 1});
      if (it == want.end()) {
        EXPECT_FALSE(grads.data(i, GradientDiffModel::ValueRole).isValid()) << kind << " " << col;
        continue;
      }
      const GradAggregate& c = *it->second;
      ++cells;
      EXPECT_EQ(grads.data(i, GradientDiffModel::ValueRole).toDouble(), c.rel_l2) << kind;
      EXPECT_EQ(grads.data(i, GradientDiffModel::CosineRole).toDouble(), c.cosine) << kind;
      EXPECT_EQ(grads.data(i, GradientDiffModel::RowsDifferingRole).toLongLong(), c.rows_differing) << kind;
      const double level = grads.data(i, GradientDiffModel::LevelRole).toDouble();
      if (c.rel_l2 == 0)
        EXPECT_EQ(level, 0.0) << kind;
      else
        EXPECT_GT(level, 0.1) << kind;  // a difference never looks like equality
      const QString tip = grads.data(i, Qt::ToolTipRole).toString();
      EXPECT_TRUE(tip.contains(QStringLiteral("cosine"))) << tip.toStdString();
      EXPECT_TRUE(tip.contains(QStringLiteral("rows differing: %1 of %2").arg(c.rows_differing).arg(c.rows)))
          << tip.toStdString();
    }
  }
  EXPECT_EQ(cells, int(d.cells.size()));

  // Two cells recomputed from the full gradients the traces hold: every routed expert's down_proj of
  // layer 3 together, and layer 0's wq_a.
  const TrainingRecord ra = *TraceReader::open(tp.a).training(0);
  const TrainingRecord rb = *TraceReader::open(tp.b).training(0);
  const ModelConfig& cfg = doc.data().summary->a.config;
  const auto row_of = [&](const std::string& kind) {
    return int(std::find(d.kinds.begin(), d.kinds.end(), kind) - d.kinds.begin());
  };
  GradRef experts, wq;
  for (const auto& [name, g] : ra.full_grads)  // name order
    if (name.rfind("model.layers.3.mlp.experts.", 0) == 0 &&
        name.find(".down_proj.weight") != std::string::npos)
      experts.add(g, rb.full_grads.at(name));
  wq.add(ra.full_grads.at("model.layers.0.self_attn.wq_a.weight"),
         rb.full_grads.at("model.layers.0.self_attn.wq_a.weight"));
  for (const auto& [kind, layer, ref] :
       {std::tuple{std::string("mlp.experts.*.down_proj.weight"), 3, &experts},
        std::tuple{std::string("self_attn.wq_a.weight"), 0, &wq}}) {
    ASSERT_GT(ref->sq_d, 0) << kind;
    const QModelIndex i = grads.index(row_of(kind), layer + 1);
    EXPECT_NEAR(grads.data(i, GradientDiffModel::ValueRole).toDouble(), ref->rel_l2(), 1e-9 * ref->rel_l2())
        << kind;
    EXPECT_NEAR(grads.data(i, GradientDiffModel::CosineRole).toDouble(), ref->cosine(), 1e-9) << kind;
    const QString tip = grads.data(i, Qt::ToolTipRole).toString();
    EXPECT_TRUE(tip.startsWith(QString::fromStdString(kind) + QStringLiteral(", layer %1").arg(layer)))
        << tip.toStdString();
  }
  EXPECT_EQ(grads.cell(row_of("mlp.experts.*.down_proj.weight"), 4)->params, cfg.n_routed_experts);
  EXPECT_TRUE(
      summary.value(QStringLiteral("setting decisions_kinds")).contains(QStringLiteral("indexer,routing")));
  EXPECT_FALSE(summary.value(QStringLiteral("training loss")).isEmpty());

  // A training step against a plain step of the same tokens: no cells, the note says why.
  ASSERT_TRUE(load(doc, tp.a, tp.rollout).finished);
  EXPECT_FALSE(grads.available());
  EXPECT_EQ(grads.rowCount(), 0);
  EXPECT_TRUE(grads.caption().contains(QStringLiteral("only A"))) << grads.caption().toStdString();
  // Two plain steps: nothing either.
  ASSERT_TRUE(load(doc, gui_traces().a, gui_traces().b).finished);
  EXPECT_EQ(grads.rowCount(), 0);
  EXPECT_EQ(grads.columnCount(), 0);
  guard.expect_clean();
}

}  // namespace
}  // namespace dsv4::gui

// ---- colour scales ----------------------------------------------------------------------------------

namespace {

// The rule of gui/models/colour_scale.h, written out on sorted values: the worst end is the extreme
// value, the ideal end the value of rank ceil(5 % n) from the ideal side, at least a decade apart.
struct ScaleReference {
  double worst, ideal;
};
ScaleReference scale_reference(std::vector<double> v, bool lower_is_worse) {
  std::erase_if(v, [](double x) { return !(x > 0) || !std::isfinite(x); });
  std::sort(v.begin(), v.end());
  const size_t rank = std::max<size_t>(1, size_t(std::ceil(0.05 * double(v.size()))));
  if (!lower_is_worse) return {v.back(), v[rank - 1]};
  return {v.front(), v[v.size() - rank]};
}

}  // namespace

TEST(GuiColourScale, EndsFollowTheRuleWithinOneBin) {
  const double bin = 1.0625;  // the widest bin, as a ratio: 1/16 of an octave's span at its bottom
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> decade(-12, 2);
  for (int trial = 0; trial < 40; ++trial) {
    const int n = 1 + int(rng() % 3000);
    std::vector<double> v;
    LogScaleCounts counts;
    for (int i = 0; i < n; ++i) {
      // Log-uniform values, some outliers far out on either side, and values that are not counted.
      double x = std::pow(10.0, decade(rng) / (trial % 3 + 1));
      if (i % 97 == 5) x = 1e-30;
      if (i % 211 == 7) x = 1e20;
      if (i % 53 == 1) x = (i % 2) ? 0.0 : -x;
      x = double(float(x));
      v.push_back(x);
      counts.add(float(x));
    }
    counts.add(std::numeric_limits<float>::quiet_NaN());
    counts.add(std::numeric_limits<float>::infinity());
    for (bool lower_is_worse : {false, true}) {
      SCOPED_TRACE(::testing::Message()
                   << "trial " << trial << " n " << n << " lower_is_worse " << lower_is_worse);
      const ScaleReference ref = scale_reference(v, lower_is_worse);
      const LogScaleCounts::Range r = counts.range(lower_is_worse);
      ASSERT_LT(r.lo, r.hi);
      EXPECT_GE(r.hi / r.lo, 10 * (1 - 1e-12));
      if (!lower_is_worse) {
        EXPECT_EQ(r.hi, ref.worst);
        if (ref.ideal < ref.worst / 10) {  // the percentile, to the bin that holds it
          EXPECT_LE(r.lo, ref.ideal);
          EXPECT_GT(r.lo, ref.ideal / bin);
        } else {
          EXPECT_DOUBLE_EQ(r.lo, ref.worst / 10);  // a decade below the worst value
        }
        const double smallest = *std::min_element(v.begin(), v.end(), [](double a, double b) {
          return (a > 0 ? a : INFINITY) < (b > 0 ? b : INFINITY);
        });
        EXPECT_EQ(r.clipped, smallest < r.lo);
      } else {
        EXPECT_EQ(r.lo, ref.worst);
        if (ref.ideal > ref.worst * 10) {
          EXPECT_GE(r.hi, ref.ideal);
          EXPECT_LT(r.hi, ref.ideal * bin);
        } else {
          EXPECT_DOUBLE_EQ(r.hi, ref.worst * 10);
        }
      }
    }
  }
}

TEST(GuiColourScale, RowsCountedApartMergeToTheWhole) {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> e(-20, 5);
  LogScaleCounts whole, parts;
  std::vector<LogScaleCounts> rows(7);
  for (int i = 0; i < 5000; ++i) {
    const float x = std::pow(10.0f, e(rng));
    whole.add(x);
    rows[size_t(i) % rows.size()].add(x);
  }
  for (const auto& r : rows) parts.add(r);
  EXPECT_EQ(parts.count(), whole.count());
  for (bool lower_is_worse : {false, true}) {
    const auto a = whole.range(lower_is_worse), b = parts.range(lower_is_worse);
    EXPECT_EQ(a.lo, b.lo);
    EXPECT_EQ(a.hi, b.hi);
    EXPECT_EQ(a.clipped, b.clipped);
  }
  const LogScaleCounts empty;
  EXPECT_EQ(empty.range(false).lo, 1e-6);
  EXPECT_EQ(empty.range(false).hi, 1);
}

// A few tiny differences (here a single 1e-15) no longer press every other cell to the dark end:
// the bulk spreads over the scale, the worst cell is the darkest, and the outlier is still drawn as a
// difference.
TEST(GuiColourScale, OverviewOfAnOutlierAndABulk) {
  constexpr int kTokens = 4000;
  Dataset d = dsv4::test::synthetic_pair(kTokens);
  const int layers = d.summary->layers;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> e(-4, -2);
  for (int l = 0; l < layers; ++l) {
    auto c = std::make_shared<LayerChunk>();
    c->layer = l;
    for (const auto& m : all_metrics())
      if (m.comparison) c->values[int(m.metric)].assign(kTokens, m.lower_is_worse ? 1.0f : 0.0f);
    auto& mhc = c->values[int(Metric::MhcDifference)];
    for (auto& x : mhc) x = std::pow(10.0f, e(rng));
    if (l == 0) mhc[17] = 1e-15f, mhc[18] = 0;
    if (l == 1) mhc[5] = 0.5f;
    d.chunks[0].push_back(c);
  }
  TraceDocument doc;
  HeatmapModel heat(&doc);
  doc.adopt(std::move(d));
  heat.setMetric(Metric::MhcDifference);
  EXPECT_TRUE(heat.scaleClipped());
  EXPECT_EQ(heat.scaleWorst(), 0.5f);
  std::vector<int> levels;
  for (int l = 0; l < heat.rowCount(); ++l)
    for (int t = 0; t < kTokens; ++t)
      if (!(l == 0 && (t == 17 || t == 18)) && !(l == 1 && t == 5)) levels.push_back(heat.level(l, t));
  std::sort(levels.begin(), levels.end());
  const double median = double(levels[levels.size() / 2]) / kLevelMax;
  // Between 1e-4 and 1e-2 on a scale from about 1.3e-4 to 0.5: the middle of the bulk (1e-3) sits a
  // third of the way up (0.34 with the difference floor); a min-to-max scale from 1e-15 put it at 0.84.
  EXPECT_GT(median, 0.2);
  EXPECT_LT(median, 0.75);
  EXPECT_EQ(heat.level(1, 5), kLevelMax);
  EXPECT_GT(heat.level(0, 17), 0);  // a difference, however small, is above the pale end
  EXPECT_EQ(heat.level(0, 18), 0);  // equal
}

// A parallel recording (the env key of capture/env.h) is named in the banner and the summary; one
// recorded in one process is named as such, and a pair of one-process runs says nothing in the banner.
TEST(GuiNavigator, ParallelLayoutsInTheBannerAndTheSummary) {
  TraceDocument doc;
  NavigatorModel nav(&doc);
  SummaryModel summary(&doc);
  Dataset d = navigator_dataset();
  doc.adopt(Dataset(d));
  EXPECT_FALSE(nav.banner().contains(QStringLiteral("layout")));
  EXPECT_EQ(summary.value(QStringLiteral("layout")), QStringLiteral("one process"));

  auto parallel = std::make_shared<LoadSummary>(*d.summary);
  parallel->a.env[kEnvParallel] = "expert parallel over 2 MPI ranks";
  d.summary = parallel;
  doc.adopt(Dataset(d));
  EXPECT_TRUE(nav.banner().contains(
      QStringLiteral("<b>layouts</b>: A expert parallel over 2 MPI ranks, B one process")))
      << nav.banner().toStdString();
  EXPECT_EQ(summary.value(QStringLiteral("layout A")), QStringLiteral("expert parallel over 2 MPI ranks"));
  EXPECT_EQ(summary.value(QStringLiteral("layout B")), QStringLiteral("one process"));

  auto both = std::make_shared<LoadSummary>(*parallel);
  both->b->env[kEnvParallel] = "expert parallel over 2 MPI ranks";
  d.summary = both;
  doc.adopt(Dataset(d));
  EXPECT_TRUE(nav.banner().contains(QStringLiteral("<b>layout</b>: both expert parallel over 2 MPI ranks")));
  EXPECT_EQ(summary.value(QStringLiteral("layout")), QStringLiteral("expert parallel over 2 MPI ranks"));
}

// The Precision bisect table over a report that `dsv4 bisect` wrote: the singles in their ranked
// order, the halving, the whole switch last; the values as the report has them; a file that is not a
// report is refused with its name and the table keeps what it showed.
TEST(GuiBisect, TheTableIsTheReport) {
  const dsv4::Weights& w = dsv4::test::tiny();
  std::vector<int32_t> toks(64);
  for (size_t i = 0; i < toks.size(); ++i) toks[i] = int32_t((i * 37 + 5) % size_t(w.config().vocab_size));
  dsv4::BisectOptions o;
  o.a = dsv4::profile_train();
  o.b = dsv4::profile_by_name("deepseek-inference-v2");
  const dsv4::BisectReport rep = dsv4::bisect_profiles(w, {toks}, o);
  const auto dir = std::filesystem::temp_directory_path() / ("dsv4_gui_bisect_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "bisect.json").string();
  std::ofstream(path) << dsv4::bisect_to_json(rep);
  dsv4::gui::BisectModel m;
  QAbstractItemModelTester tester(&m, QAbstractItemModelTester::FailureReportingMode::Fatal);
  ASSERT_TRUE(m.load(QString::fromStdString(path)).isEmpty());
  ASSERT_EQ(m.rowCount(), int(rep.single.size() + rep.groups.size() + 1));
  EXPECT_EQ(m.columnCount(), 8);
  for (size_t i = 0; i < rep.single.size(); ++i) {
    const QString sites = m.data(m.index(int(i), dsv4::gui::BisectModel::Sites)).toString();
    EXPECT_TRUE(sites.startsWith(QString::fromStdString(rep.single[i].sites[0]) + " = ")) << sites.toStdString();
    EXPECT_EQ(m.data(m.index(int(i), dsv4::gui::BisectModel::Explained)).toString(),
              QStringLiteral("%1%").arg(100.0 * rep.single[i].explained, 0, 'f', 1));
  }
  const int last = m.rowCount() - 1;
  EXPECT_EQ(m.data(m.index(last, dsv4::gui::BisectModel::Kind)).toString(), QStringLiteral("all"));
  EXPECT_EQ(m.data(m.index(last, dsv4::gui::BisectModel::IndexerFlips)).toString(),
            QStringLiteral("%1 (%2 tie)").arg(rep.all.m.indexer_flips).arg(rep.all.m.indexer_tie_flips));
  EXPECT_TRUE(m.caption().contains(QStringLiteral("train → deepseek-inference-v2")));
  const std::string bad = (dir / "bad.json").string();
  std::ofstream(bad) << "{\"format\": \"dsv4-diff\", \"version\": 1}";
  const QString error = m.load(QString::fromStdString(bad));
  EXPECT_TRUE(error.contains(QString::fromStdString(bad))) << error.toStdString();
  EXPECT_EQ(m.rowCount(), int(rep.single.size() + rep.groups.size() + 1));
  std::filesystem::remove_all(dir);
}


