// The dsv4-view program: --screenshot of the pair and of one trace (PNG of the requested size whose
// heatmap area is not blank, by pixel statistics), the same under xvfb-run, and bad input (a file that
// is not a trace, a truncated trace, a newer format version, bad arguments): an error on stderr
// naming the problem and exit code 2, never a crash.
#include <gtest/gtest.h>

#include <QImage>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>

#include "cli_util.h"
#include "gui_test_util.h"

namespace {

namespace fs = std::filesystem;
using dsv4::test::CliResult;
using dsv4::test::gui_traces;
using dsv4::test::run_shell;

CliResult view(const std::string& args, const std::string& env = "QT_QPA_PLATFORM=offscreen") {
  return run_shell(env + " " + std::string(DSV4_VIEW_PATH) + " " + args);
}

struct Rect {
  int x = 0, y = 0, w = 0, h = 0;
};
bool heatmap_rect(const std::string& out, Rect* r) {
  const auto p = out.find("heatmap-cells ");
  if (p == std::string::npos) return false;
  std::istringstream in(out.substr(p + 14));
  return bool(in >> r->x >> r->y >> r->w >> r->h);
}

// The heatmap area holds many colours, little background, and varies in brightness.
void expect_heatmap_not_blank(const QImage& img, const Rect& r) {
  ASSERT_GT(r.w, 100);
  ASSERT_GT(r.h, 50);
  ASSERT_LE(r.x + r.w, img.width());
  ASSERT_LE(r.y + r.h, img.height());
  const QRgb background = img.pixel(r.x + r.w + 2 < img.width() ? r.x + r.w + 2 : 0, r.y + r.h - 1);
  std::set<QRgb> colours;
  int64_t n = 0, non_background = 0;
  double sum = 0, sum2 = 0;
  for (int y = r.y; y < r.y + r.h; ++y)
    for (int x = r.x; x < r.x + r.w; ++x) {
      const QRgb c = img.pixel(x, y);
      colours.insert(c);
      non_background += c != background;
      const double l = qGray(c);
      sum += l, sum2 += l * l, ++n;
    }
  const double mean = sum / n, sd = std::sqrt(std::max(0.0, sum2 / n - mean * mean));
  EXPECT_GT(colours.size(), 20u);
  EXPECT_GT(double(non_background) / n, 0.8);
  EXPECT_GT(sd, 8.0);
  EXPECT_LT(mean, 250.0);
}

class GuiCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { (void)gui_traces(); }
  void SetUp() override {
    dir_ = dsv4::test::temp_dir(::testing::UnitTest::GetInstance()->current_test_info()->name());
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string dir_;
};

// The pair (train vs rollout: numerics differ in every cell, a few decisions flip) opens on the routing
// flips: a few marks on an agreeing background, not a wall. With the mHC difference the wall is there.
TEST_F(GuiCli, ScreenshotOfThePair) {
  const std::string png = dir_ + "/pair.png";
  auto r = view("--screenshot " + png + " --size 1280x800 " + gui_traces().a + " " + gui_traces().b);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("metric routing-agreement\n"), std::string::npos) << r.out;
  Rect rect;
  ASSERT_TRUE(heatmap_rect(r.out, &rect)) << r.out;
  QImage img(QString::fromStdString(png));
  ASSERT_FALSE(img.isNull());
  EXPECT_EQ(img.width(), 1280);
  EXPECT_EQ(img.height(), 800);
  std::map<QRgb, int64_t> count;
  for (int y = rect.y; y < rect.y + rect.h; ++y)
    for (int x = rect.x; x < rect.x + rect.w; ++x) ++count[img.pixel(x, y)];
  int64_t most = 0;
  for (const auto& [c, n] : count) most = std::max(most, n);
  EXPECT_GE(count.size(), 2u);                               // the flips are marked
  EXPECT_GT(double(most) / (int64_t(rect.w) * rect.h), 0.5);  // on a mostly agreeing background

  r = view("--screenshot " + png + " --size 1280x800 --metric mhc-diff " + gui_traces().a + " " + gui_traces().b);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("metric mhc-diff\n"), std::string::npos) << r.out;
  ASSERT_TRUE(heatmap_rect(r.out, &rect)) << r.out;
  expect_heatmap_not_blank(QImage(QString::fromStdString(png)), rect);
}

TEST_F(GuiCli, ScreenshotWithSelectionMetricAndSingleTrace) {
  const std::string png = dir_ + "/sel.png";
  auto r = view("--screenshot " + png + " --select 3,60 --metric indexer-overlap " + gui_traces().a + " " +
                gui_traces().b);
  ASSERT_EQ(r.code, 0) << r.out;
  QImage img(QString::fromStdString(png));
  EXPECT_EQ(img.size(), QSize(1600, 1000));
  // Indexer overlap has data on the two C4 layers only: fewer colours, still not blank.
  const std::string single = dir_ + "/single.png";
  r = view("--screenshot " + single + " --metric expert-load --timing " + gui_traces().a);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("timing first_paint_ms="), std::string::npos) << r.out;
  Rect rect;
  ASSERT_TRUE(heatmap_rect(r.out, &rect)) << r.out;
  img = QImage(QString::fromStdString(single));
  EXPECT_EQ(img.size(), QSize(1600, 1000));
  r = view("--screenshot " + single + " " + gui_traces().a);
  ASSERT_EQ(r.code, 0) << r.out;
  ASSERT_TRUE(heatmap_rect(r.out, &rect)) << r.out;
  expect_heatmap_not_blank(QImage(QString::fromStdString(single)), rect);
}

TEST_F(GuiCli, ScreenshotUnderXvfb) {
  if (run_shell("command -v xvfb-run").code != 0) GTEST_SKIP() << "xvfb-run is not installed";
  const std::string png = dir_ + "/xvfb.png";
  const auto r = view("--screenshot " + png + " --size 1280x800 --metric mhc-diff " + gui_traces().a + " " +
                          gui_traces().b,
                      "env -u QT_QPA_PLATFORM xvfb-run -a");
  ASSERT_EQ(r.code, 0) << r.out;
  Rect rect;
  ASSERT_TRUE(heatmap_rect(r.out, &rect)) << r.out;
  const QImage img(QString::fromStdString(png));
  EXPECT_EQ(img.size(), QSize(1280, 800));
  expect_heatmap_not_blank(img, rect);
}

TEST_F(GuiCli, BadFilesExitTwoWithAMessage) {
  struct Case {
    std::string file, expect;
  };
  const std::vector<Case> cases = {
      {dsv4::test::write_not_a_trace(dir_), "notes.h5"},
      {dsv4::test::write_truncated(gui_traces().a, dir_), "truncated.h5"},
      {dsv4::test::write_with_version(gui_traces().a, dir_, 999), "999"},
      {dir_ + "/missing.h5", "missing.h5"},
  };
  for (const auto& c : cases) {
    const auto r = view("--screenshot " + dir_ + "/x.png " + c.file);
    EXPECT_EQ(r.code, 2) << c.file << ": " << r.out;
    EXPECT_NE(r.out.find("dsv4-view: "), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(c.expect), std::string::npos) << r.out;
    EXPECT_FALSE(fs::exists(dir_ + "/x.png"));
  }
  // The pair with a bad candidate: exit 2 with the message, and the window as a user sees it (the
  // problem panel) rendered all the same.
  const auto r = view("--screenshot " + dir_ + "/x.png --size 1024x700 " + gui_traces().a + " " + cases[0].file);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("notes.h5"), std::string::npos) << r.out;
  ASSERT_TRUE(fs::exists(dir_ + "/x.png"));
  EXPECT_EQ(QImage(QString::fromStdString(dir_ + "/x.png")).size(), QSize(1024, 700));
}

TEST_F(GuiCli, BadArgumentsExitTwo) {
  const std::string ab = gui_traces().a + " " + gui_traces().b;
  const std::string png = " --screenshot " + dir_ + "/x.png ";
  for (const auto& [args, expect] : std::vector<std::pair<std::string, std::string>>{
           {png + "--select x,1 " + ab, "--select"},
           {png + "--select 9,0 " + ab, "6 layers"},
           {png + "--select 0," + std::to_string(gui_traces().tokens) + " " + ab,
            std::to_string(gui_traces().tokens) + " tokens"},
           {png + "--metric entropy " + ab, "unknown metric"},
           {png + "--metric expert-load " + ab, "single trace"},
           {png + "--metric mhc-diff " + gui_traces().a, "two traces"},
           {png + "--seq 3 " + ab, "--seq 3"},
           {png + "--size 10x10 " + ab, "--size"},
           {png, "needs a trace"},
           {png + ab + " " + gui_traces().a, "at most two"},
           {"--bogus " + ab, "bogus"},
       }) {
    const auto r = view(args);
    EXPECT_EQ(r.code, 2) << args << ": " << r.out;
    EXPECT_NE(r.out.find(expect), std::string::npos) << args << ": " << r.out;
  }
  // Without a display and without --screenshot: a clear message, not Qt's abort.
  const auto r = view(gui_traces().a, "env -u DISPLAY -u WAYLAND_DISPLAY -u QT_QPA_PLATFORM");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("no display"), std::string::npos) << r.out;
}

}  // namespace
