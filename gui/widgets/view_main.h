// The dsv4-view program: command line, interactive window, and the --screenshot batch mode.
//
//   dsv4-view [A [B]]                                     interactive
//   dsv4-view --screenshot out.png [--select LAYER,TOKEN] [--metric NAME] [--seq N] [--step A[,B]]
//             [--size WxH] [--timing] A [B]
//
// --screenshot loads the traces offscreen (QT_QPA_PLATFORM=offscreen unless a display is set),
// selects the cell (by default the first divergence, or in single-trace mode the worst cell of the
// metric), waits for its detail, renders the whole window into a PNG of exactly --size pixels and
// exits 0. It prints one line "heatmap-cells X Y W H", the heatmap's cell area in the image, and with
// --timing one line "timing first_paint_ms=… load_ms=… vmrss_kib=…". Errors (a file that is not a
// trace, a newer format, a bad argument) go to stderr and exit with 2.
#pragma once

#include <QSize>
#include <QString>
#include <QStringList>
#include <cstdint>
#include <optional>

#include "gui/models/dataset.h"

namespace dsv4::gui {

struct ViewOptions {
  QStringList traces;                             // A [B]
  QString screenshot;                             // empty: interactive
  std::optional<std::pair<int, int64_t>> select;  // (layer, token)
  std::optional<Metric> metric;
  int seq = 0;
  int step_a = 0, step_b = 0;
  QSize size{1600, 1000};
  bool timing = false;
  QString bisect;  // a `dsv4 bisect` report to show in the Precision bisect tab
};

// Parses argv (without the program name); on failure returns nullopt and sets *error.
std::optional<ViewOptions> parse_view_args(const QStringList& args, QString* error);
int view_main(int argc, char** argv);

}  // namespace dsv4::gui
