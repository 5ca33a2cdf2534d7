// The viewer's widgets, offscreen: open the pair, click a cell and check the detail panel's sets,
// "first divergence" (Ctrl+D) selects the cell the diff engine reports, a click on the log-prob chart
// selects that token's column, drag and drop, exports, the error dialog, responsiveness while
// loading, the Gradients tab of two training steps, and the heatmap's frame time while scrolling 32k
// tokens.
#include <gtest/gtest.h>

#include <QAbstractItemModelTester>
#include <QAbstractSeries>
#include <QAction>
#include <QApplication>
#include <QChart>
#include <QComboBox>
#include <QDropEvent>
#include <QElapsedTimer>
#include <QFile>
#include <QGroupBox>
#include <QHeaderView>
#include <QLabel>
#include <QMessageBox>
#include <QMimeData>
#include <QProgressBar>
#include <QPushButton>
#include <QScrollBar>
#include <QSettings>
#include <QSplitter>
#include <QStyle>
#include <QStyleOptionComboBox>
#include <QTabBar>
#include <QTabWidget>
#include <QTableView>
#include <QTest>
#include <QTextDocument>
#include <QTimer>
#include <QUrl>
#include <QValueAxis>
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <set>

#include "capture/trace_reader.h"
#include "cli_util.h"
#include "gui/models/heatmap_model.h"
#include "gui/models/metrics.h"
#include "gui/models/navigator_model.h"
#include "gui/widgets/detail_panel.h"
#include "gui/widgets/heatmap_view.h"
#include "gui/widgets/logprob_chart.h"
#include "gui/widgets/main_window.h"
#include "gui_test_util.h"
#include "replay/diff.h"

namespace {

namespace fs = std::filesystem;
using namespace dsv4;
using namespace dsv4::gui;
using dsv4::test::gui_traces;
using dsv4::test::wait_until;

bool open_and_wait(MainWindow& w, const std::string& a, const std::string& b = {}) {
  bool finished = false, failed = false;
  auto c1 = QObject::connect(w.document(), &TraceDocument::loadFinished, [&] { finished = true; });
  auto c2 =
      QObject::connect(w.document(), &TraceDocument::loadFailed, [&](const LoadError&) { failed = true; });
  w.openTraces(QString::fromStdString(a), QString::fromStdString(b));
  wait_until([&] { return finished || failed; });
  QObject::disconnect(c1);
  QObject::disconnect(c2);
  return finished;
}

// Waits until the detail panel shows (layer, token).
bool wait_detail(MainWindow& w, int layer, int64_t token) {
  return wait_until([&] {
    const auto d = w.detailPanel()->detail();
    return d && d->layer == layer && d->token == token;
  });
}

QPoint cell_center(HeatmapView* v, int row, int col) {
  const QRect area = v->cellRect();
  const int rh = std::clamp(area.height() / v->model()->rowCount(), 3, 60);
  const double x = area.left() + (col + 0.5) * v->pixelsPerColumn() - v->horizontalScrollBar()->value();
  return QPoint(int(x), area.top() + row * rh + rh / 2 - v->verticalScrollBar()->value());
}

std::set<int32_t> row_set(const std::vector<int32_t>& ids, int64_t width, int64_t t) {
  std::set<int32_t> s;
  for (int64_t j = 0; j < width; ++j)
    if (ids[t * width + j] >= 0) s.insert(ids[t * width + j]);
  return s;
}

class GuiWidgets : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { (void)gui_traces(); }
};

TEST_F(GuiWidgets, SelectingACellShowsBothIndexerSetsAndExperts) {
  MainWindow w(false);
  w.resize(1400, 900);
  w.show();
  ASSERT_TRUE(open_and_wait(w, gui_traces().a, gui_traces().b));
  const TraceReader ra = TraceReader::open(gui_traces().a), rb = TraceReader::open(gui_traces().b);
  const int layer = 3;
  const auto ia = ra.indexer(0, 0, layer), ib = rb.indexer(0, 0, layer);
  const int T = int(gui_traces().tokens);
  const int64_t width = int64_t(ia->ids.size()) / T;
  int token = -1;
  for (int t = 0; t < T && token < 0; ++t)
    if (row_set(ia->ids, width, t) != row_set(ib->ids, width, t)) token = t;
  ASSERT_GE(token, 0);

  // Zoom so every cell is wide enough to click, bring the cell into view, click it.
  HeatmapView* hv = w.heatmapView();
  hv->setPixelsPerColumn(12);
  hv->select(0, token);
  QTest::mouseClick(hv->viewport(), Qt::LeftButton, {}, cell_center(hv, layer, token));
  EXPECT_EQ(hv->selectedRow(), layer);
  EXPECT_EQ(hv->selectedColumn(), token);
  ASSERT_TRUE(wait_detail(w, layer, token));

  const auto d = w.detailPanel()->detail();
  const auto sa = row_set(ia->ids, width, token), sb = row_set(ib->ids, width, token);
  EXPECT_EQ(std::set<int32_t>(d->indexer_a.begin(), d->indexer_a.end()), sa);
  EXPECT_EQ(std::set<int32_t>(d->indexer_b.begin(), d->indexer_b.end()), sb);
  // The panel's set table lists the union with each group's side.
  IndexerSetModel* sets = w.detailPanel()->indexerModel();
  std::set<int32_t> uni = sa;
  uni.insert(sb.begin(), sb.end());
  ASSERT_EQ(sets->rowCount(), int(uni.size()));
  for (int r = 0; r < sets->rowCount(); ++r) {
    const int g = sets->data(sets->index(r, 0)).toInt();
    const QString side = sets->data(sets->index(r, 3)).toString();
    EXPECT_EQ(side, sa.count(g) && sb.count(g) ? "common" : sa.count(g) ? "only A" : "only B") << g;
  }
  const auto ga = ra.routing(0, 0, layer);
  std::set<int32_t> experts_a = row_set(ga->ids, ga->k, token);
  int rows_a = 0;
  ExpertModel* em = w.detailPanel()->expertModel();
  for (int r = 0; r < em->rowCount(); ++r)
    if (em->data(em->index(r, 1)).isValid()) {
      EXPECT_TRUE(experts_a.count(em->data(em->index(r, 0)).toInt()));
      ++rows_a;
    }
  EXPECT_EQ(rows_a, int(experts_a.size()));
  EXPECT_TRUE(w.detailPanel()->headline().contains(QStringLiteral("token %1").arg(token)));
  // The chart marks the selected token.
  EXPECT_GT(w.chart()->pointsShown(), 0);
}

TEST_F(GuiWidgets, FirstDivergenceSelectsTheCellOfTheDiffEngine) {
  MainWindow w(false);
  w.resize(1400, 900);
  w.show();
  ASSERT_TRUE(open_and_wait(w, gui_traces().a, gui_traces().b));
  const DiffReport rep = diff_traces(gui_traces().a, gui_traces().b, DiffOptions{});
  ASSERT_TRUE(rep.first_divergence);
  const auto& f = *rep.first_divergence;
  // The trace pair diverges first in a per-token tensor of a layer: the cell is (layer, row).
  ASSERT_GE(f.layer, 0);
  // After loading, the window shows the navigator's most severe item, and the banner names the first
  // divergence and the flip counts of the report.
  NavigatorModel* nav = w.navigatorModel();
  ASSERT_GE(nav->rowCount(), 2);
  EXPECT_EQ(nav->current(), 0);
  const Divergence top = *nav->item(0);
  EXPECT_EQ(w.heatmapView()->selectedRow(), top.cell_layer);
  EXPECT_EQ(w.heatmapView()->selectedColumn(), int(top.token));
  EXPECT_TRUE(w.banner()->isVisibleTo(&w));
  EXPECT_TRUE(w.banner()->text().contains(QString::fromStdString(f.tensor)))
      << w.banner()->text().toStdString();
  // The first divergence is marked on the heatmap whatever is selected.
  EXPECT_EQ(w.heatmapView()->markedCell(), std::pair(f.layer, int(f.row)));
  int64_t confident = 0, tie = 0;
  for (const auto& l : rep.layers)
    confident += l.indexer_confident_flips + l.routing_confident_flips,
        tie += l.indexer_tie_flips + l.routing_tie_flips;
  EXPECT_TRUE(w.banner()->text().contains(QStringLiteral("%1 confident, %2 tie").arg(confident).arg(tie)))
      << w.banner()->text().toStdString();
  // F3 / Shift+F3 walk the list.
  w.activateWindow();
  QTest::keyClick(&w, Qt::Key_F3);
  EXPECT_EQ(nav->current(), 1);
  EXPECT_EQ(w.heatmapView()->selectedRow(), nav->item(1)->cell_layer);
  EXPECT_EQ(w.heatmapView()->selectedColumn(), int(nav->item(1)->token));
  QTest::keyClick(&w, Qt::Key_F3, Qt::ShiftModifier);
  EXPECT_EQ(nav->current(), 0);
  EXPECT_EQ(w.heatmapView()->selectedColumn(), int(top.token));
  // Select something else, then Ctrl+D.
  w.selectCell(5, 10);
  EXPECT_EQ(w.heatmapView()->selectedRow(), 5);
  w.activateWindow();
  QTest::keyClick(&w, Qt::Key_D, Qt::ControlModifier);
  EXPECT_EQ(w.heatmapView()->selectedRow(), f.layer);
  EXPECT_EQ(w.heatmapView()->selectedColumn(), int(f.row));
  EXPECT_TRUE(wait_detail(w, f.layer, f.row));
  EXPECT_EQ(w.currentSeq(), f.seq);

  // Linked views: a Tensors row selects its first differing cell; a heatmap cell selects its layer's
  // row of the Layers table.
  int first_row = -1;
  for (size_t i = 0; i < rep.tensors.size() && first_row < 0; ++i)
    if (rep.tensors[i].name == f.tensor && rep.tensors[i].layer == f.layer) first_row = int(i);
  ASSERT_GE(first_row, 0);
  w.selectCell(5, 10);
  w.tabs()->setCurrentIndex(MainWindow::kTensorsTab);
  QApplication::processEvents();
  QTableView* tv = w.tensorView();
  tv->scrollTo(tv->model()->index(first_row, 0));
  QTest::mouseClick(tv->viewport(), Qt::LeftButton, {},
                    tv->visualRect(tv->model()->index(first_row, 0)).center());
  EXPECT_EQ(w.heatmapView()->selectedRow(), f.layer);
  EXPECT_EQ(w.heatmapView()->selectedColumn(), int(f.row));
  w.selectCell(2, 7);
  ASSERT_TRUE(w.layerView()->selectionModel()->hasSelection());
  EXPECT_EQ(w.layerView()->selectionModel()->selectedRows().value(0).row(), 2);
}

TEST_F(GuiWidgets, ChartClickSelectsTheTokenColumnAndMetricsSwitch) {
  MainWindow w(false);
  w.resize(1400, 900);
  w.show();
  ASSERT_TRUE(open_and_wait(w, gui_traces().a, gui_traces().b));
  w.selectCell(2, 5);
  LogprobChart* chart = w.chart();
  QApplication::processEvents();
  const int token = int(gui_traces().tokens * 2 / 3);
  const auto* y = qobject_cast<QValueAxis*>(chart->chart()->axes(Qt::Vertical).first());
  ASSERT_NE(y, nullptr);
  const QPointF pos = chart->chart()->mapToPosition(QPointF(token, (y->min() + y->max()) / 2),
                                                    chart->chart()->series().first());
  QTest::mouseClick(chart->viewport(), Qt::LeftButton, {}, chart->mapFromScene(pos));
  EXPECT_EQ(w.heatmapView()->selectedColumn(), token);
  EXPECT_EQ(w.heatmapView()->selectedRow(), 2);
  EXPECT_TRUE(wait_detail(w, 2, token));
  // Hovering shows that token's values (those of the trace files).
  const QPoint at = chart->mapFromScene(pos);
  EXPECT_EQ(chart->tokenAt(at), token);
  const TraceReader ra = TraceReader::open(gui_traces().a), rb = TraceReader::open(gui_traces().b);
  const float la = ra.logprobs(0, 0)[size_t(token)], lb = rb.logprobs(0, 0)[size_t(token)];
  const QString hover = chart->valueText(token);
  EXPECT_TRUE(hover.contains(QStringLiteral("log p A %1").arg(double(la), 0, 'g', 6))) << hover.toStdString();
  EXPECT_TRUE(hover.contains(QStringLiteral("log p B %1").arg(double(lb), 0, 'g', 6))) << hover.toStdString();
  // Difference only: A and B hidden, B − A shown.
  chart->setDifferenceOnly(true);
  int shown = 0;
  for (QAbstractSeries* s : chart->chart()->series())
    shown += s->isVisible() && s->name() != QStringLiteral("selected");
  EXPECT_EQ(shown, 1);
  chart->setDifferenceOnly(false);

  // Every metric renders something other than the background in the cell area.
  for (Metric m : w.heatmapModel()->availableMetrics()) {
    ASSERT_TRUE(w.setMetric(m));
    const QImage img = w.heatmapView()->viewport()->grab().toImage();
    const QRect cells = w.heatmapView()->cellRect();
    std::set<QRgb> colours;
    for (int y = cells.top(); y < cells.bottom(); y += 3)
      for (int x = cells.left(); x < cells.right(); x += 3) colours.insert(img.pixel(x, y));
    EXPECT_GT(colours.size(), 2u) << metric_info(m).name;
  }
  EXPECT_FALSE(w.setMetric(Metric::ExpertLoad));  // a single-trace metric
  // The threshold highlight fades the cells within it.
  ASSERT_TRUE(w.setMetric(Metric::RoutingAgreement));
  w.heatmapModel()->setThresholdEnabled(true);
  int beyond = 0;
  for (int r = 0; r < w.heatmapModel()->rowCount(); ++r)
    for (int c = 0; c < w.heatmapModel()->columnCount(); ++c)
      beyond +=
          w.heatmapModel()->data(w.heatmapModel()->index(r, c), HeatmapModel::BeyondThresholdRole).toBool();
  EXPECT_GT(beyond, 0);
  EXPECT_LT(beyond, w.heatmapModel()->rowCount() * w.heatmapModel()->columnCount());
}

TEST_F(GuiWidgets, ExportsWriteFilesOnTheWorker) {
  const std::string dir = dsv4::test::temp_dir("exports");
  MainWindow w(false);
  w.resize(1400, 900);
  w.show();
  ASSERT_TRUE(open_and_wait(w, gui_traces().a, gui_traces().b));
  QStringList done;
  QObject::connect(w.document(), &TraceDocument::exportDone, [&](const QString& p, const QString& err) {
    EXPECT_TRUE(err.isEmpty()) << err.toStdString();
    done << p;
  });
  const QString d = QString::fromStdString(dir);
  const QSize heatmap_size = w.heatmapView()->size();  // as exported (the layout may settle later)
  w.exportHeatmapPng(d + "/heatmap.png");
  w.exportChartPng(d + "/chart.png");
  w.exportReportJson(d + "/diff.json");
  w.exportReportCsv(d + "/csv");
  ASSERT_TRUE(wait_until([&] { return done.size() == 4; }));
  QImage heat(d + "/heatmap.png");
  EXPECT_EQ(heat.size(), heatmap_size);
  EXPECT_FALSE(QImage(d + "/chart.png").isNull());
  std::ifstream in(dir + "/diff.json");
  const std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(json, diff_to_json(diff_traces(gui_traces().a, gui_traces().b, DiffOptions{})));
  for (const char* f : {"layers.csv", "tensors.csv", "tokens.csv"})
    EXPECT_TRUE(fs::exists(dir + "/csv/" + f)) << f;
  fs::remove_all(dir);
}

TEST_F(GuiWidgets, DropOpensThePairAndRecentFilesRemembersIt) {
  QSettings().remove(QStringLiteral("recent"));
  MainWindow w(true);
  w.resize(1200, 800);
  w.show();
  bool finished = false;
  QObject::connect(w.document(), &TraceDocument::loadFinished, [&] { finished = true; });
  QMimeData mime;
  mime.setUrls({QUrl::fromLocalFile(QString::fromStdString(gui_traces().a)),
                QUrl::fromLocalFile(QString::fromStdString(gui_traces().b))});
  QDragEnterEvent enter(QPoint(100, 100), Qt::CopyAction, &mime, Qt::LeftButton, Qt::NoModifier);
  QApplication::sendEvent(&w, &enter);
  EXPECT_TRUE(enter.isAccepted());
  QDropEvent drop(QPointF(100, 100), Qt::CopyAction, &mime, Qt::LeftButton, Qt::NoModifier);
  QApplication::sendEvent(&w, &drop);
  ASSERT_TRUE(wait_until([&] { return finished; }));
  EXPECT_TRUE(w.document()->data().comparison());
  const QStringList recent = QSettings().value(QStringLiteral("recent")).toStringList();
  ASSERT_FALSE(recent.isEmpty());
  EXPECT_EQ(recent[0], QString::fromStdString(gui_traces().a + "\n" + gui_traces().b));
}

TEST_F(GuiWidgets, BadFileShowsADialogNamingTheProblem) {
  const std::string dir = dsv4::test::temp_dir("dialog");
  MainWindow w(true);
  w.resize(1000, 700);
  w.show();
  bool failed = false;
  QObject::connect(w.document(), &TraceDocument::loadFailed, [&](const LoadError&) { failed = true; });
  w.openTraces(QString::fromStdString(dsv4::test::write_with_version(gui_traces().a, dir, 999)));
  ASSERT_TRUE(wait_until([&] { return failed; }));
  QMessageBox* box = nullptr;
  ASSERT_TRUE(wait_until([&] {
    box = w.findChild<QMessageBox*>();
    return box && box->isVisible();
  }));
  EXPECT_TRUE(box->text().contains(QStringLiteral("version999.h5"))) << box->text().toStdString();
  EXPECT_TRUE(box->text().contains(QStringLiteral("999"))) << box->text().toStdString();
  EXPECT_EQ(box->windowTitle(), QStringLiteral("Trace format too new"));
  box->close();
  // The window still works afterwards.
  ASSERT_TRUE(open_and_wait(w, gui_traces().a));
  fs::remove_all(dir);
}

TEST_F(GuiWidgets, SingleTraceModeAndResponsivenessWhileLoading) {
  MainWindow w(false);
  w.resize(1400, 900);
  w.show();
  // The UI thread keeps serving a 5 ms timer while the worker loads.
  QElapsedTimer clock;
  clock.start();
  qint64 last = 0, worst_gap = 0;
  QTimer tick;
  QObject::connect(&tick, &QTimer::timeout, [&] {
    const qint64 now = clock.elapsed();
    worst_gap = std::max(worst_gap, now - last);
    last = now;
  });
  tick.start(5);
  // openTraces only posts the request: it returns at once and the results arrive later through the
  // event loop.
  bool finished = false;
  auto c = QObject::connect(w.document(), &TraceDocument::loadFinished, [&] { finished = true; });
  QElapsedTimer call;
  call.start();
  w.openTraces(QString::fromStdString(gui_traces().a), QString::fromStdString(gui_traces().b));
  const double call_ms = call.nsecsElapsed() / 1e6;
  EXPECT_FALSE(finished);
  EXPECT_TRUE(w.document()->loading());
  EXPECT_TRUE(w.progressBar()->isVisible());
  ASSERT_TRUE(wait_until([&] { return finished; }));
  QObject::disconnect(c);
  tick.stop();
  std::printf("[ perf ] openTraces returned in %.2f ms; UI-thread timer: worst gap %lld ms during the load\n",
              call_ms, (long long)worst_gap);
  EXPECT_LT(call_ms, 100.0);
  EXPECT_LT(worst_gap, 1000);
  EXPECT_FALSE(w.progressBar()->isVisible());

  ASSERT_TRUE(open_and_wait(w, gui_traces().a));
  EXPECT_FALSE(w.document()->data().comparison());
  EXPECT_FALSE(w.goToFirstDivergence());
  // The default selection of single-trace mode is the worst cell (the smallest router margin).
  EXPECT_GE(w.heatmapView()->selectedRow(), 0);
  ASSERT_TRUE(w.setMetric(Metric::ExpertLoad));
  EXPECT_EQ(w.heatmapModel()->columnCount(), w.document()->data().summary->a.config.n_routed_experts);
  ASSERT_TRUE(w.setMetric(Metric::IndexerMargin));
  w.selectCell(3, 80);
  EXPECT_TRUE(wait_detail(w, 3, 80));
  EXPECT_FALSE(w.detailPanel()->detail()->comparison);
}

// Two training steps: the Gradients tab appears with the kind × layer table, coloured and with
// tooltips; it goes away for a pair of plain steps.
TEST_F(GuiWidgets, GradientsTabForTwoTrainingSteps) {
  MainWindow w(false);
  w.resize(1400, 900);
  w.show();
  const auto& tp = dsv4::test::gui_training_traces();
  QTabWidget* tabs = w.tabs();
  EXPECT_FALSE(tabs->isTabVisible(MainWindow::kGradientsTab));
  ASSERT_TRUE(open_and_wait(w, tp.a, tp.b));
  ASSERT_TRUE(wait_until([&] { return w.gradientModel()->available(); }));
  EXPECT_TRUE(tabs->isTabVisible(MainWindow::kGradientsTab));
  const TrainingDiff& d = *w.document()->data().report->training;
  EXPECT_EQ(tabs->tabText(MainWindow::kGradientsTab),
            QStringLiteral("Gradients (%1 differ)").arg(d.params_differing));
  tabs->setCurrentIndex(MainWindow::kGradientsTab);
  QTableView* v = w.gradientView();
  ASSERT_EQ(v->model(), w.gradientModel());
  EXPECT_EQ(v->model()->rowCount(), int(d.kinds.size()));
  // The largest rel-L2 is the darkest cell.
  int best_row = -1, best_col = -1;
  double best = -1;
  for (int r = 0; r < v->model()->rowCount(); ++r)
    for (int c = 0; c < v->model()->columnCount(); ++c) {
      const QVariant x = v->model()->index(r, c).data(GradientDiffModel::ValueRole);
      if (x.isValid() && x.toDouble() > best) best = x.toDouble(), best_row = r, best_col = c;
    }
  ASSERT_GT(best, 0);
  EXPECT_DOUBLE_EQ(v->model()->index(best_row, best_col).data(GradientDiffModel::LevelRole).toDouble(), 1.0);
  const QColor dark = v->model()->index(best_row, best_col).data(Qt::BackgroundRole).value<QBrush>().color();
  EXPECT_EQ(dark.rgb(), heat_color(1.0));
  v->scrollTo(v->model()->index(best_row, best_col));
  const QRect cell = v->visualRect(v->model()->index(best_row, best_col));
  EXPECT_TRUE(v->viewport()->rect().intersects(cell));
  const QImage img = v->viewport()->grab().toImage();
  EXPECT_EQ(img.pixelColor(cell.left() + 2, cell.top() + 2).rgb(), heat_color(1.0));

  ASSERT_TRUE(open_and_wait(w, gui_traces().a, gui_traces().b));
  ASSERT_TRUE(wait_until([&] { return w.document()->data().report != nullptr; }));
  EXPECT_FALSE(tabs->isTabVisible(MainWindow::kGradientsTab));
}

// A synthetic 32k-token comparison of 43 layers (the released models' count): the heatmap's frame
// time while scrolling programmatically, zoomed in and zoomed out.
// Two traces of different tokens: the load fails after A's summary arrived, and the window is left
// empty (not half-loaded) with the problem and buttons that open each trace alone.
TEST_F(GuiWidgets, FailedPairLeavesAUsableWindowThatOpensEachTraceAlone) {
  const std::string dir = dsv4::test::temp_dir("failed-pair");
  const std::string other = dir + "/other.h5";
  const auto rec =
      dsv4::test::run_cli("record --preset tiny --seed 7 --random " + std::to_string(gui_traces().tokens) +
                          " --token-seed 4 --out " + other);
  ASSERT_EQ(rec.code, 0) << rec.out;
  MainWindow w(false);
  w.resize(1024, 700);
  w.show();
  // The empty window: nothing to go to, no banner, no problem.
  EXPECT_FALSE(w.firstDivergenceAction()->isEnabled());
  EXPECT_EQ(w.heatmapModel()->rowCount(), 0);
  EXPECT_FALSE(w.problemPanel()->isVisibleTo(&w));
  EXPECT_FALSE(w.banner()->isVisibleTo(&w));
  ASSERT_FALSE(open_and_wait(w, gui_traces().a, other));
  EXPECT_FALSE(w.document()->data().summary);  // not half-loaded
  EXPECT_EQ(w.heatmapModel()->rowCount(), 0);
  EXPECT_FALSE(w.progressBar()->isVisibleTo(&w));
  EXPECT_FALSE(w.goToFirstDivergence());
  EXPECT_FALSE(w.firstDivergenceAction()->isEnabled());
  ASSERT_TRUE(w.problemPanel()->isVisibleTo(&w));
  EXPECT_TRUE(
      w.openAloneButton(0)->text().contains(QString::fromStdString(fs::path(gui_traces().a).filename())));
  EXPECT_TRUE(w.openAloneButton(1)->text().contains(QStringLiteral("other.h5")));
  EXPECT_FALSE(w.compareAnywayButton()->isVisibleTo(&w));  // the tokens differ, not the weights
  // Open B alone: one trace, the problem gone.
  bool finished = false;
  QObject::connect(w.document(), &TraceDocument::loadFinished, [&] { finished = true; });
  w.openAloneButton(1)->click();
  ASSERT_TRUE(wait_until([&] { return finished; }));
  EXPECT_FALSE(w.document()->data().comparison());
  EXPECT_EQ(w.document()->data().summary->a.path, other);
  EXPECT_FALSE(w.problemPanel()->isVisibleTo(&w));
  EXPECT_GT(w.heatmapModel()->rowCount(), 0);
  fs::remove_all(dir);
}

// Every piece of text of the window at 1024 × 700, on every tab, with a cell selected: no table header
// narrower than its text (QFontMetrics against the section width), no single-line label or combo box
// narrower than its text, no tab title cut.
TEST_F(GuiWidgets, NothingIsElidedAt1024x700) {
  MainWindow w(false);
  w.resize(1024, 700);
  w.show();
  ASSERT_TRUE(open_and_wait(w, gui_traces().a, gui_traces().b));
  ASSERT_TRUE(wait_until([&] { return w.detailPanel()->detail() != nullptr; }));
  QApplication::processEvents();
  std::vector<std::string> cut;
  auto check_visible = [&](const std::string& where) {
    for (QTableView* t : w.findChildren<QTableView*>()) {
      if (!t->isVisible() || !t->model()) continue;
      QHeaderView* h = t->horizontalHeader();
      const QFontMetrics fm(h->font());
      const int margin = h->style()->pixelMetric(QStyle::PM_HeaderMargin, nullptr, h);
      for (int i = 0; i < h->count(); ++i) {
        if (h->isSectionHidden(i)) continue;
        const QString text = t->model()->headerData(i, Qt::Horizontal).toString();
        const int need = fm.horizontalAdvance(text) + 2 * margin;
        if (h->sectionSize(i) < need)
          cut.push_back(where + ": header '" + text.toStdString() + "' " + std::to_string(h->sectionSize(i)) +
                        " px < " + std::to_string(need));
      }
    }
    for (QLabel* l : w.findChildren<QLabel*>()) {
      if (!l->isVisible() || l->wordWrap() || l->text().isEmpty() || Qt::mightBeRichText(l->text())) continue;
      if (l->width() < l->fontMetrics().horizontalAdvance(l->text()))
        cut.push_back(where + ": label '" + l->text().toStdString() + "'");
    }
    for (QComboBox* c : w.findChildren<QComboBox*>()) {
      if (!c->isVisible() || c->currentText().isEmpty()) continue;
      const int need = c->fontMetrics().horizontalAdvance(c->currentText());
      QStyleOptionComboBox opt;
      opt.initFrom(c);
      const QRect edit =
          c->style()->subControlRect(QStyle::CC_ComboBox, &opt, QStyle::SC_ComboBoxEditField, c);
      if (edit.width() < need)
        cut.push_back(where + ": combo '" + c->currentText().toStdString() + "' " +
                      std::to_string(edit.width()) + " px < " + std::to_string(need));
    }
  };
  QTabWidget* tabs = w.tabs();
  for (int i = 0; i < tabs->count(); ++i) {
    if (!tabs->isTabVisible(i)) continue;
    tabs->setCurrentIndex(i);
    QApplication::processEvents();
    check_visible("tab " + tabs->tabText(i).toStdString());
    const QFontMetrics fm(tabs->tabBar()->font());
    if (tabs->tabBar()->tabRect(i).width() < fm.horizontalAdvance(tabs->tabText(i)))
      cut.push_back("tab title '" + tabs->tabText(i).toStdString() + "'");
  }
  EXPECT_TRUE(cut.empty()) << [&] {
    std::string s;
    for (const auto& c : cut) s += c + "\n";
    return s;
  }();

  // The detail panel's sections fold to their titles and unfold again; its two columns are split.
  int sections = 0;
  for (QGroupBox* box : w.detailPanel()->findChildren<QGroupBox*>()) {
    if (!box->isVisible()) continue;
    ++sections;
    ASSERT_TRUE(box->isCheckable()) << box->title().toStdString();
    const auto children = box->findChildren<QWidget*>(QString(), Qt::FindDirectChildrenOnly);
    ASSERT_FALSE(children.isEmpty());
    const int open_height = box->sizeHint().height();
    std::vector<QWidget*> shown;
    for (QWidget* c : children)
      if (c->isVisible()) shown.push_back(c);
    ASSERT_FALSE(shown.empty());
    box->setChecked(false);
    for (QWidget* c : children) EXPECT_FALSE(c->isVisible()) << box->title().toStdString();
    EXPECT_LT(box->sizeHint().height(), open_height) << box->title().toStdString();
    box->setChecked(true);
    for (QWidget* c : shown) EXPECT_TRUE(c->isVisible()) << box->title().toStdString();
  }
  EXPECT_GE(sections, 3);
  EXPECT_NE(w.detailPanel()->findChild<QSplitter*>(), nullptr);
}

// Zooming keeps the selected column where it is (and the selection), instead of zooming about the
// centre and pushing it out of view.
TEST_F(GuiWidgets, ZoomKeepsTheSelectedColumnInPlace) {
  MainWindow w(false);
  w.resize(1024, 700);
  w.show();
  ASSERT_TRUE(open_and_wait(w, gui_traces().a, gui_traces().b));
  HeatmapView* hv = w.heatmapView();
  hv->fitToWidth();
  const int col = int(gui_traces().tokens / 6);  // far left of the centre
  w.selectCell(2, col);
  QApplication::processEvents();
  const int x0 = cell_center(hv, 2, col).x();
  for (int i = 0; i < 4; ++i) {
    w.activateWindow();
    QTest::keyClick(&w, Qt::Key_Plus, Qt::ControlModifier);
  }
  EXPECT_GT(hv->pixelsPerColumn(), 4.0 * hv->cellRect().width() / gui_traces().tokens);
  EXPECT_EQ(hv->selectedRow(), 2);
  EXPECT_EQ(hv->selectedColumn(), col);
  EXPECT_NEAR(cell_center(hv, 2, col).x(), x0, hv->pixelsPerColumn());
}

TEST(GuiHeatmapPerf, ScrollingThirtyTwoThousandTokens) {
  constexpr int kLayers = 43;
  constexpr int64_t kTokens = 32768;
  Dataset d = dsv4::test::synthetic_pair(kTokens, kLayers);
  auto seq = std::make_shared<SeqTokens>(*d.seqs[0]);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(0, 1);
  for (int64_t t = 0; t + 1 < kTokens; ++t) {
    seq->logprobs_a[size_t(t)] = -5 - u(rng);
    seq->logprobs_b[size_t(t)] = seq->logprobs_a[size_t(t)] + 0.05f * (u(rng) - 0.5f);
  }
  d.seqs = {seq};
  for (int l = 0; l < kLayers; ++l) {
    auto c = std::make_shared<LayerChunk>();
    c->layer = l;
    for (const auto& m : all_metrics()) {
      if (!m.comparison) continue;
      auto& v = c->values[int(m.metric)];
      v.resize(kTokens);
      for (auto& x : v) x = u(rng) < 0.9f ? (m.lower_is_worse ? 1.0f : 0.0f) : u(rng) * 0.01f;
    }
    d.chunks[0].push_back(c);
  }
  MainWindow w(false);
  w.resize(1600, 1000);
  w.show();
  QElapsedTimer adopt;
  adopt.start();
  w.document()->adopt(std::move(d));
  const double adopt_ms = adopt.nsecsElapsed() / 1e6;
  ASSERT_TRUE(w.setMetric(Metric::MhcDifference));
  HeatmapView* hv = w.heatmapView();
  QApplication::processEvents();
  ASSERT_EQ(hv->model()->columnCount(), kTokens);

  auto scroll_frames = [&](int frames, int step) {
    std::vector<double> ms;
    QScrollBar* h = hv->horizontalScrollBar();
    for (int i = 0; i < frames; ++i) {
      h->setValue((h->value() + step) % std::max(h->maximum(), 1));
      QElapsedTimer t;
      t.start();
      hv->viewport()->repaint();  // synchronous: the whole frame, cache rebuild included
      ms.push_back(t.nsecsElapsed() / 1e6);
    }
    std::sort(ms.begin(), ms.end());
    return std::make_tuple(std::accumulate(ms.begin(), ms.end(), 0.0) / ms.size(), ms[ms.size() * 95 / 100],
                           ms.back());
  };
  hv->setPixelsPerColumn(4);
  const auto [mean_in, p95_in, max_in] = scroll_frames(200, 37);
  hv->fitToWidth();
  // Zoomed out every pixel aggregates ~25 tokens; scroll by changing zoom slightly each frame.
  std::vector<double> out_ms;
  for (int i = 0; i < 50; ++i) {
    hv->setPixelsPerColumn(hv->pixelsPerColumn() * (i % 2 ? 1.01 : 1 / 1.01));
    QElapsedTimer t;
    t.start();
    hv->viewport()->repaint();
    out_ms.push_back(t.nsecsElapsed() / 1e6);
  }
  const double mean_out = std::accumulate(out_ms.begin(), out_ms.end(), 0.0) / out_ms.size();
  std::printf(
      "[ perf ] heatmap %d layers x %lld tokens: adopt %.1f ms; frame while scrolling at 4 px/token: "
      "mean %.2f ms, p95 %.2f ms, max %.2f ms; whole sequence in view: mean %.2f ms\n",
      kLayers, (long long)kTokens, adopt_ms, mean_in, p95_in, max_in, mean_out);
  EXPECT_LT(mean_in, 40.0);
  EXPECT_LT(mean_out, 80.0);
}

}  // namespace

// The chart and the heatmap show the same tokens: zooming the heatmap zooms the chart; a drag across
// the chart zooms the heatmap to the dragged tokens (and the chart follows); Ctrl + wheel on the chart
// zooms both about the pointer; a double click shows every token again.
TEST_F(GuiWidgets, ChartAndHeatmapZoomTogether) {
  MainWindow w(false);
  w.resize(1400, 900);
  w.show();
  ASSERT_TRUE(open_and_wait(w, gui_traces().a, gui_traces().b));
  HeatmapView* hv = w.heatmapView();
  LogprobChart* ch = w.chart();
  const double n = hv->model()->columnCount();
  ASSERT_GT(n, 60);
  auto settle = [] {
    for (int i = 0; i < 5; ++i) QApplication::processEvents();
  };
  // The viewport position of token t on the chart's axis, halfway up the plot.
  auto at_token = [&](double t) {
    QAbstractSeries* s = ch->chart()->series().first();
    const QPointF in_chart(ch->chart()->mapToPosition(QPointF(t, 0), s).x(),
                           ch->chart()->plotArea().center().y());
    return ch->mapFromScene(ch->chart()->mapToScene(in_chart));
  };
  auto chart_ends = [&] {
    const QRectF plot = ch->chart()->plotArea();
    const QPoint l = ch->mapFromScene(ch->chart()->mapToScene(QPointF(plot.left() + 1, plot.center().y())));
    const QPoint r = ch->mapFromScene(ch->chart()->mapToScene(QPointF(plot.right() - 1, plot.center().y())));
    return std::pair{ch->tokenAt(l), ch->tokenAt(r)};
  };

  hv->showColumns(20, 60);
  settle();
  auto v = hv->visibleColumns();
  EXPECT_NEAR(v.first, 20, 0.5);
  EXPECT_NEAR(v.second, 60, 0.5);
  EXPECT_EQ(ch->tokenRange(), v);
  auto [left, right] = chart_ends();
  EXPECT_NEAR(left, 20, 1);
  EXPECT_NEAR(right, 59, 1);

  hv->fitToWidth();
  settle();
  EXPECT_EQ(hv->visibleColumns(), std::pair(0.0, n));
  std::tie(left, right) = chart_ends();
  EXPECT_EQ(left, 0);
  EXPECT_EQ(right, int(n) - 2);  // a log-prob for every token but the last (it predicts nothing)

  // A drag from token 30 to token 70 (a drag is not a click: the selection stays).
  const int selected = hv->selectedColumn();
  QTest::mousePress(ch->viewport(), Qt::LeftButton, {}, at_token(30));
  QTest::mouseMove(ch->viewport(), at_token(50));
  QTest::mouseMove(ch->viewport(), at_token(70));
  QTest::mouseRelease(ch->viewport(), Qt::LeftButton, {}, at_token(70));
  settle();
  v = hv->visibleColumns();
  EXPECT_NEAR(v.first, 30, 1);
  EXPECT_NEAR(v.second, 71, 1);
  EXPECT_EQ(ch->tokenRange(), v);
  EXPECT_EQ(hv->selectedColumn(), selected);

  // Ctrl + wheel up about token 50: a third less on either side, token 50 where it was.
  const QPoint p50 = at_token(50);
  QWheelEvent wheel(p50, ch->viewport()->mapToGlobal(p50), QPoint(), QPoint(0, 120), Qt::NoButton,
                    Qt::ControlModifier, Qt::NoScrollPhase, false);
  QApplication::sendEvent(ch->viewport(), &wheel);
  settle();
  const auto z = hv->visibleColumns();
  EXPECT_NEAR(z.second - z.first, (v.second - v.first) / 1.5, 1.5);
  EXPECT_NEAR((50.5 - z.first) / (z.second - z.first), (50.5 - v.first) / (v.second - v.first), 0.05);

  QTest::mouseDClick(ch->viewport(), Qt::LeftButton, {}, at_token(40));
  settle();
  EXPECT_EQ(hv->visibleColumns(), std::pair(0.0, n));
}

// File ▸ Open bisect report (here through MainWindow::openBisect): the Precision bisect tab appears
// with the report's ranking and caption; a bad file leaves the tab hidden and says why.
TEST(GuiBisectTab, OpensAReport) {
  const auto dir = fs::temp_directory_path() / ("dsv4_gui_bisect_tab_" + std::to_string(getpid()));
  fs::create_directories(dir);
  const std::string out = (dir / "b.json").string();
  const auto r = dsv4::test::run_cli("bisect --profile-a train --profile-b rollout --preset tiny --seed 7 --random 48 --out " + out);
  ASSERT_EQ(r.code, 0) << r.out;
  MainWindow w(false);
  EXPECT_FALSE(w.tabs()->isTabVisible(MainWindow::kBisectTab));
  const QString error = w.openBisect(QString::fromStdString((dir / "missing.json").string()));
  EXPECT_TRUE(error.contains(QStringLiteral("missing.json"))) << error.toStdString();
  EXPECT_FALSE(w.tabs()->isTabVisible(MainWindow::kBisectTab));
  ASSERT_TRUE(w.openBisect(QString::fromStdString(out)).isEmpty());
  EXPECT_TRUE(w.tabs()->isTabVisible(MainWindow::kBisectTab));
  EXPECT_EQ(w.tabs()->currentIndex(), MainWindow::kBisectTab);
  EXPECT_EQ(w.tabs()->tabText(MainWindow::kBisectTab), QStringLiteral("Precision bisect"));
  std::ifstream in(out);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const dsv4::BisectReport rep = dsv4::bisect_from_json(text, out);
  EXPECT_EQ(rep.sites.size(), 9u);  // train and rollout: the seven reduce.* sites, kv.quant, indexer.quant
  EXPECT_EQ(w.bisectModel()->rowCount(), int(rep.single.size() + rep.groups.size() + 1));
  fs::remove_all(dir);
}
