#include "gui/widgets/view_main.h"

#include <QApplication>
#include <QCommandLineParser>
#include <QFile>
#include <QTimer>
#include <cstdio>
#include <cstdlib>

#include "capture/version.h"
#include "gui/widgets/heatmap_view.h"
#include "gui/widgets/main_window.h"

namespace dsv4::gui {

namespace {

constexpr int kExitInput = 2;    // a bad file or argument
constexpr int kExitTimeout = 3;  // the screenshot did not complete in time
constexpr int kScreenshotTimeoutMs = 300000;

void add_options(QCommandLineParser& p) {
  p.setApplicationDescription(QStringLiteral("Viewer of dsv4 traces and of the divergence of two runs."));
  p.addHelpOption();
  p.addVersionOption();
  p.addPositionalArgument(QStringLiteral("A"), QStringLiteral("Trace (the reference when comparing)"),
                          QStringLiteral("[A"));
  p.addPositionalArgument(QStringLiteral("B"), QStringLiteral("Candidate trace to compare with A"),
                          QStringLiteral("[B]]"));
  p.addOptions({
      {QStringLiteral("screenshot"), QStringLiteral("Render the window into FILE (PNG) and exit."),
       QStringLiteral("FILE")},
      {QStringLiteral("select"), QStringLiteral("Select the cell LAYER,TOKEN."),
       QStringLiteral("LAYER,TOKEN")},
      {QStringLiteral("metric"),
       QStringLiteral("Heatmap metric (indexer-overlap, routing-agreement, mhc-diff, "
                      "tensor-digest, tensor-rel-l2, indexer-margin, router-margin, expert-load)."),
       QStringLiteral("NAME")},
      {QStringLiteral("seq"), QStringLiteral("Sequence of the step's batch (default 0)."),
       QStringLiteral("N")},
      {QStringLiteral("step"), QStringLiteral("Steps to show: A or A,B (default 0)."),
       QStringLiteral("A[,B]")},
      {QStringLiteral("size"), QStringLiteral("Window size for --screenshot (default 1600x1000)."),
       QStringLiteral("WxH")},
      {QStringLiteral("timing"), QStringLiteral("With --screenshot: print load timing and memory.")},
      {QStringLiteral("bisect"),
       QStringLiteral("Show a `dsv4 bisect` report (JSON) in the Precision bisect tab."), QStringLiteral("FILE")},
  });
}

long vmrss_kib() {
  QFile f(QStringLiteral("/proc/self/status"));
  if (!f.open(QIODevice::ReadOnly)) return -1;
  for (const QByteArray& line : f.readAll().split('\n'))
    if (line.startsWith("VmRSS:")) return line.mid(6).trimmed().split(' ').value(0).toLong();
  return -1;
}

int fail(const QString& message) {
  std::fprintf(stderr, "dsv4-view: %s\n", message.toLocal8Bit().constData());
  return kExitInput;
}

int run_screenshot(QApplication& app, const ViewOptions& o) {
  MainWindow w(false);
  w.resize(o.size);
  if (o.metric) w.setMetric(*o.metric);
  if (!o.bisect.isEmpty())
    if (const QString error = w.openBisect(o.bisect); !error.isEmpty()) return fail(error);
  TraceDocument* doc = w.document();
  bool done = false;
  auto quit = [&](int code, const QString& message = {}) {
    if (done) return;
    done = true;
    if (!message.isEmpty()) std::fprintf(stderr, "dsv4-view: %s\n", message.toLocal8Bit().constData());
    app.exit(code);
  };
  auto save = [&] {
    QApplication::processEvents();
    return w.grab().toImage().save(o.screenshot, "PNG");
  };
  auto grab = [&] {
    if (done) return;
    if (!save()) return quit(kExitInput, QStringLiteral("cannot write %1").arg(o.screenshot));
    const QRect cells = w.heatmapView()->cellRect();
    const QPoint tl = w.heatmapView()->viewport()->mapTo(&w, cells.topLeft());
    std::printf("heatmap-cells %d %d %d %d\n", tl.x(), tl.y(), cells.width(), cells.height());
    std::printf("metric %s\n", metric_info(w.heatmapModel()->metric()).name);
    if (o.timing)
      std::printf(
          "timing first_paint_ms=%.1f load_ms=%.1f max_stall_ms=%.1f stalls_over_16ms=%d vmrss_kib=%ld\n",
          w.firstPaintMs(), w.loadMs(), w.loadStalls().maxStallMs(), w.loadStalls().stallsOverBudget(),
          vmrss_kib());
    std::fflush(stdout);
    quit(0);
  };
  // A pair that cannot be compared still renders: the window with its problem panel and the offer to
  // open each trace alone, as a user sees it; the exit code and message say it failed. A single trace
  // that cannot be read leaves nothing to show.
  QObject::connect(doc, &TraceDocument::loadFailed, &w, [&](const LoadError& e) {
    if (!e.pair) return quit(kExitInput, e.message);
    const QString message = e.message;
    QTimer::singleShot(100, &w, [&, message] {
      if (done) return;
      quit(kExitInput,
           save() ? message : message + QStringLiteral(" (and cannot write %1)").arg(o.screenshot));
    });
  });
  QObject::connect(doc, &TraceDocument::loadCanceled, &w,
                   [&] { quit(kExitInput, QStringLiteral("loading cancelled")); });
  QObject::connect(doc, &TraceDocument::datasetReset, &w, [&] {
    const Dataset& d = doc->data();
    if (o.metric && w.heatmapModel()->metric() != *o.metric)
      return quit(kExitInput,
                  QStringLiteral("metric %1 needs %2")
                      .arg(QString::fromUtf8(metric_info(*o.metric).name),
                           d.comparison() ? QStringLiteral("a single trace") : QStringLiteral("two traces")));
    if (o.seq >= d.seq_count())
      return quit(kExitInput,
                  QStringLiteral("--seq %1: the step has %2 sequence(s)").arg(o.seq).arg(d.seq_count()));
    if (o.select && (o.select->first >= d.layers() || o.select->second >= d.tokens(o.seq)))
      return quit(kExitInput,
                  QStringLiteral("--select %1,%2: the trace has %3 layers and %4 tokens in sequence %5")
                      .arg(o.select->first)
                      .arg(o.select->second)
                      .arg(d.layers())
                      .arg(d.tokens(o.seq))
                      .arg(o.seq));
    if (o.seq != w.currentSeq()) w.setSequence(o.seq);
  });
  // Once loaded the window selects the requested cell (or its default one); the rendering waits for
  // that cell's detail.
  QObject::connect(doc, &TraceDocument::detailReady, &w,
                   [&](DetailPtr) { QTimer::singleShot(100, &w, grab); });
  QObject::connect(doc, &TraceDocument::detailFailed, &w,
                   [&](const QString&) { QTimer::singleShot(100, &w, grab); });
  QObject::connect(doc, &TraceDocument::loadFinished, &w, [&] {
    if (done) return;
    if (w.heatmapView()->selectedRow() < 0) QTimer::singleShot(100, &w, grab);  // no detail to wait for
  });
  if (o.select) w.selectWhenLoaded(o.seq, o.select->first, o.select->second);
  QTimer::singleShot(kScreenshotTimeoutMs, &w, [&] { quit(kExitTimeout, QStringLiteral("timed out")); });
  w.show();
  w.openTraces(o.traces.value(0), o.traces.value(1), o.step_a, o.step_b);
  return app.exec();
}

}  // namespace

std::optional<ViewOptions> parse_view_args(const QStringList& args, QString* error) {
  QCommandLineParser p;
  add_options(p);
  QStringList argv = args;
  argv.prepend(QStringLiteral("dsv4-view"));
  if (!p.parse(argv)) {
    *error = p.errorText();
    return std::nullopt;
  }
  ViewOptions o;
  o.traces = p.positionalArguments();
  if (o.traces.size() > 2) {
    *error = QStringLiteral("at most two traces (A and B), got %1").arg(o.traces.size());
    return std::nullopt;
  }
  o.screenshot = p.value(QStringLiteral("screenshot"));
  if (!o.screenshot.isEmpty() && o.traces.isEmpty()) {
    *error = QStringLiteral("--screenshot needs a trace");
    return std::nullopt;
  }
  if (p.isSet(QStringLiteral("select"))) {
    const QStringList v = p.value(QStringLiteral("select")).split(',');
    bool ok1 = false, ok2 = false;
    const int layer = v.value(0).toInt(&ok1);
    const qlonglong token = v.value(1).toLongLong(&ok2);
    if (v.size() != 2 || !ok1 || !ok2 || layer < 0 || token < 0) {
      *error = QStringLiteral("--select wants LAYER,TOKEN (two non-negative integers), got '%1'")
                   .arg(p.value("select"));
      return std::nullopt;
    }
    o.select = std::make_pair(layer, int64_t(token));
  }
  if (p.isSet(QStringLiteral("metric"))) {
    try {
      o.metric = metric_from_name(p.value(QStringLiteral("metric")).toStdString());
    } catch (const std::exception& e) {
      *error = QString::fromStdString(e.what());
      return std::nullopt;
    }
  }
  if (p.isSet(QStringLiteral("seq"))) {
    bool ok = false;
    o.seq = p.value(QStringLiteral("seq")).toInt(&ok);
    if (!ok || o.seq < 0) {
      *error = QStringLiteral("--seq wants a non-negative integer");
      return std::nullopt;
    }
  }
  if (p.isSet(QStringLiteral("step"))) {
    const QStringList v = p.value(QStringLiteral("step")).split(',');
    bool ok1 = false, ok2 = true;
    o.step_a = v.value(0).toInt(&ok1);
    o.step_b = v.size() > 1 ? v.value(1).toInt(&ok2) : o.step_a;
    if (v.size() > 2 || !ok1 || !ok2 || o.step_a < 0 || o.step_b < 0) {
      *error = QStringLiteral("--step wants A or A,B (non-negative integers)");
      return std::nullopt;
    }
  }
  if (p.isSet(QStringLiteral("size"))) {
    const QStringList v = p.value(QStringLiteral("size")).toLower().split('x');
    bool ok1 = false, ok2 = false;
    const int w = v.value(0).toInt(&ok1), h = v.value(1).toInt(&ok2);
    if (v.size() != 2 || !ok1 || !ok2 || w < 400 || h < 300 || w > 8000 || h > 8000) {
      *error = QStringLiteral("--size wants WxH between 400x300 and 8000x8000");
      return std::nullopt;
    }
    o.size = QSize(w, h);
  }
  o.timing = p.isSet(QStringLiteral("timing"));
  o.bisect = p.value(QStringLiteral("bisect"));
  return o;
}

int view_main(int argc, char** argv) {
  QStringList args;
  for (int i = 1; i < argc; ++i) args << QString::fromLocal8Bit(argv[i]);
  const bool batch =
      args.contains(QStringLiteral("--screenshot")) ||
      std::any_of(args.begin(), args.end(), [](const QString& a) { return a.startsWith("--screenshot="); });
  const bool has_display =
      std::getenv("DISPLAY") || std::getenv("WAYLAND_DISPLAY") || std::getenv("QT_QPA_PLATFORM");
  const bool info_only = args.contains(QStringLiteral("--help")) || args.contains(QStringLiteral("-h")) ||
                         args.contains(QStringLiteral("--version")) || args.contains(QStringLiteral("-v"));
  if (!has_display) {
    if (!batch && !info_only)
      return fail(QStringLiteral("no display (set DISPLAY, or render with --screenshot)"));
    qputenv("QT_QPA_PLATFORM", "offscreen");
  }
  QApplication app(argc, argv);
  QApplication::setOrganizationName(QStringLiteral("dsv4"));
  QApplication::setApplicationName(QStringLiteral("dsv4-view"));
  QApplication::setApplicationVersion(QString::fromLatin1(version()));
  if (info_only) {
    QCommandLineParser p;
    add_options(p);
    p.process(app);  // prints and exits
  }
  QString error;
  const auto o = parse_view_args(args, &error);
  if (!o) return fail(error);
  if (!o->screenshot.isEmpty()) return run_screenshot(app, *o);

  MainWindow w(true);
  w.show();
  if (o->metric) w.setMetric(*o->metric);
  if (!o->bisect.isEmpty())
    if (const QString error = w.openBisect(o->bisect); !error.isEmpty()) return fail(error);
  if (!o->traces.isEmpty()) {
    if (o->select) w.selectWhenLoaded(o->seq, o->select->first, o->select->second);
    w.openTraces(o->traces.value(0), o->traces.value(1), o->step_a, o->step_b);
  }
  return app.exec();
}

}  // namespace dsv4::gui
