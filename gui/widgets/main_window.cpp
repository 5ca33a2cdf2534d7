#include "gui/widgets/main_window.h"

#include <QAction>
#include <QApplication>
#include <QCheckBox>
#include <QCloseEvent>
#include <QComboBox>
#include <QDoubleValidator>
#include <QDragEnterEvent>
#include <QDropEvent>
#include <QFileDialog>
#include <QFileInfo>
#include <QHBoxLayout>
#include <QHeaderView>
#include <QLabel>
#include <QLineEdit>
#include <QMenuBar>
#include <QMessageBox>
#include <QMimeData>
#include <QProgressBar>
#include <QPushButton>
#include <QSettings>
#include <QSignalBlocker>
#include <QSpinBox>
#include <QSplitter>
#include <QStatusBar>
#include <QTabWidget>
#include <QTableView>
#include <QToolBar>
#include <QVBoxLayout>

#include "gui/models/metrics.h"
#include "gui/widgets/detail_panel.h"
#include "gui/widgets/heatmap_view.h"
#include "gui/widgets/logprob_chart.h"

namespace dsv4::gui {

namespace {

constexpr int kMaxRecent = 10;

QTableView* table(QAbstractItemModel* m) {
  auto* t = new QTableView;
  t->setModel(m);
  t->verticalHeader()->hide();
  // Columns sized to their header and content (a horizontal scroll bar where they do not fit); no
  // stretched last column, which would be cut to the space left.
  t->horizontalHeader()->setSectionResizeMode(QHeaderView::ResizeToContents);
  t->setHorizontalScrollMode(QAbstractItemView::ScrollPerPixel);
  t->setEditTriggers(QAbstractItemView::NoEditTriggers);
  t->setSelectionBehavior(QAbstractItemView::SelectRows);
  t->verticalHeader()->setDefaultSectionSize(t->fontMetrics().height() + 4);
  t->setWordWrap(false);
  return t;
}

QString error_title(LoadErrorKind k) {
  switch (k) {
    case LoadErrorKind::NotATrace:
      return QStringLiteral("Not a dsv4 trace");
    case LoadErrorKind::UnsupportedVersion:
      return QStringLiteral("Trace format too new");
    case LoadErrorKind::Incomplete:
      return QStringLiteral("Incomplete trace");
    case LoadErrorKind::Corrupt:
      return QStringLiteral("Damaged trace");
    case LoadErrorKind::Mismatch:
      return QStringLiteral("Traces cannot be compared");
    case LoadErrorKind::Other:
      break;
  }
  return QStringLiteral("Cannot open the trace");
}

}  // namespace

MainWindow::MainWindow(bool interactive, QWidget* parent) : QMainWindow(parent), interactive_(interactive) {
  doc_ = new TraceDocument(this);
  heatmap_model_ = new HeatmapModel(doc_, this);
  token_model_ = new TokenModel(doc_, this);
  summary_model_ = new SummaryModel(doc_, this);
  layer_model_ = new LayerDiffModel(doc_, this);
  tensor_model_ = new TensorDiffModel(doc_, this);
  env_model_ = new EnvModel(doc_, this);
  kernel_model_ = new KernelModel(doc_, this);
  gradient_model_ = new GradientDiffModel(doc_, this);
  navigator_model_ = new NavigatorModel(doc_, this);
  bisect_model_ = new BisectModel(this);

  setWindowTitle(QStringLiteral("dsv4-view"));
  setAcceptDrops(true);
  buildCentral();
  buildActions();
  buildToolbar();

  status_ = new QLabel(QStringLiteral("Open a trace (File ▸ Open, or drop one or two files here)."));
  progress_ = new QProgressBar;
  progress_->setMaximumWidth(240);
  progress_->setTextVisible(true);
  cancel_ = new QPushButton(QStringLiteral("Cancel"));
  statusBar()->addWidget(status_, 1);
  statusBar()->addPermanentWidget(progress_);
  statusBar()->addPermanentWidget(cancel_);
  setLoadingUi(false);
  connect(cancel_, &QPushButton::clicked, doc_, &TraceDocument::cancel);

  connect(doc_, &TraceDocument::datasetReset, this, &MainWindow::onDatasetReset);
  connect(doc_, &TraceDocument::loadFinished, this, &MainWindow::onLoadFinished);
  connect(doc_, &TraceDocument::loadFailed, this, &MainWindow::onLoadFailed);
  connect(doc_, &TraceDocument::loadCanceled, this, [this] {
    setLoadingUi(false);
    status_->setText(QStringLiteral("Loading cancelled."));
  });
  connect(doc_, &TraceDocument::loadProgress, this, [this](int done, int total, const QString& stage) {
    progress_->setRange(0, total);
    progress_->setValue(done);
    status_->setText(stage);
  });
  connect(doc_, &TraceDocument::divergencesLoaded, this, &MainWindow::onDivergencesLoaded);
  connect(doc_, &TraceDocument::pathsChanged, this, [this] {
    const LoadRequest& r = doc_->lastRequest();
    status_->setText(QStringLiteral("The recording finished: reading %1").arg(r.path_a));
    setWindowTitle(QStringLiteral("%1 — dsv4-view")
                       .arg(r.path_b.isEmpty()
                                ? QFileInfo(r.path_a).fileName()
                                : QStringLiteral("%1 vs %2")
                                      .arg(QFileInfo(r.path_a).fileName(), QFileInfo(r.path_b).fileName())));
  });
  connect(doc_, &TraceDocument::reportLoaded, this, [this] {
    tabs_->setTabText(kEnvTab, QStringLiteral("Environment (%1 differ)").arg(env_model_->differingRows()));
    updateGradientsTab();
    if (pending_first_divergence_) {
      pending_first_divergence_ = false;
      goToFirstDivergence();
    }
    // The report brings the tie thresholds: refresh the shown detail.
    if (heatmap_->selectedRow() >= 0 && heatmap_model_->isTokenAxis())
      doc_->requestDetail(seq_, heatmap_->selectedRow(), heatmap_->selectedColumn());
  });
  connect(doc_, &TraceDocument::chunkLoaded, this, [this](int seq, int layer) {
    if (seq == seq_ && layer == heatmap_->selectedRow() && heatmap_model_->isTokenAxis())
      doc_->requestDetail(seq_, layer, heatmap_->selectedColumn());
  });
  connect(doc_, &TraceDocument::detailReady, this, [this](DetailPtr d) {
    if (d && d->seq == seq_) detail_->setDetail(std::move(d));
  });
  connect(doc_, &TraceDocument::detailFailed, this, [this](const QString& m) { detail_->setMessage(m); });
  connect(doc_, &TraceDocument::exportDone, this, [this](const QString& path, const QString& error) {
    if (error.isEmpty()) {
      status_->setText(QStringLiteral("Saved %1").arg(path));
    } else if (interactive_) {
      QMessageBox::warning(this, QStringLiteral("Export failed"), error);
    } else {
      status_->setText(error);
    }
  });

  connect(heatmap_, &HeatmapView::cellSelected, this, [this](int row, int col) {
    user_selected_ = true;
    if (!heatmap_model_->isTokenAxis()) return;  // expert columns: the tooltip says it all
    chart_->setSelectedToken(col);
    // The linked tables follow: the layer's row, and the first tensor of the layer.
    if (const DiffReport* r = doc_->data().report.get()) {
      for (size_t i = 0; i < r->layers.size(); ++i)
        if (r->layers[i].layer == row) {
          const QSignalBlocker block(layer_view_);
          layer_view_->selectRow(int(i));
        }
      for (size_t i = 0; i < r->tensors.size(); ++i)
        if (r->tensors[i].layer == row) {
          const QSignalBlocker block(tensor_view_);
          tensor_view_->selectRow(int(i));
          break;
        }
    }
    if (!doc_->requestDetail(seq_, row, col))
      detail_->setMessage(QStringLiteral("loading layer %1…").arg(row));
    emit cellSelected(seq_, row, col);
  });
  connect(heatmap_, &HeatmapView::framePainted, this, [this](double) {
    if (first_paint_ms_ < 0 && open_timer_.isValid() && heatmap_model_->rowCount() > 0) {
      first_paint_ms_ = open_timer_.nsecsElapsed() / 1e6;
      if (doc_->loading()) stalls_.start();  // the rest of the load must leave frames to draw
    }
  });
  // The chart and the heatmap show the same tokens: zooming or scrolling either moves both.
  connect(heatmap_, &HeatmapView::visibleColumnsChanged, this, [this](double first, double last) {
    if (heatmap_model_->isTokenAxis())
      chart_->setTokenRange(first, last);
    else
      chart_->setTokenRange(0, 0);  // experts across: the chart keeps every token
  });
  connect(chart_, &LogprobChart::tokenRangeRequested, this, [this](double first, double last) {
    if (heatmap_model_->isTokenAxis())
      heatmap_->showColumns(first, last);  // hands the range back through visibleColumnsChanged
    else
      chart_->setTokenRange(first, last);
  });
  connect(chart_, &LogprobChart::tokenClicked, this, [this](int token) {
    const int layer = std::max(heatmap_->selectedRow(), 0);
    selectCell(layer, token);
  });
  rebuildRecentMenu();
  showEmptyState();
  resize(1500, 950);
}

void MainWindow::buildCentral() {
  heatmap_ = new HeatmapView;
  heatmap_->setModel(heatmap_model_);
  detail_ = new DetailPanel;
  chart_ = new LogprobChart;
  chart_->setModel(token_model_);
  tabs_ = new QTabWidget;
  tabs_->setElideMode(Qt::ElideNone);  // whole titles; scroll buttons when they do not fit
  tabs_->setUsesScrollButtons(true);
  const int ni = tabs_->addTab(buildNavigator(), QStringLiteral("Divergences"));
  Q_ASSERT(ni == kDivergencesTab);
  (void)ni;
  auto* summary = table(summary_model_);
  summary->horizontalHeader()->setSectionResizeMode(0, QHeaderView::ResizeToContents);
  tabs_->addTab(summary, QStringLiteral("Summary"));
  layer_view_ = table(layer_model_);
  tensor_view_ = table(tensor_model_);
  tabs_->addTab(layer_view_, QStringLiteral("Layers"));
  tabs_->addTab(tensor_view_, QStringLiteral("Tensors"));
  connect(layer_view_, &QTableView::clicked, this, [this](const QModelIndex& i) { selectLayerRow(i.row()); });
  connect(layer_view_, &QTableView::activated, this,
          [this](const QModelIndex& i) { selectLayerRow(i.row()); });
  connect(tensor_view_, &QTableView::clicked, this,
          [this](const QModelIndex& i) { selectTensorRow(i.row()); });
  connect(tensor_view_, &QTableView::activated, this,
          [this](const QModelIndex& i) { selectTensorRow(i.row()); });
  auto* env = table(env_model_);
  env->horizontalHeader()->setSectionResizeMode(0, QHeaderView::ResizeToContents);
  tabs_->addTab(env, QStringLiteral("Environment"));
  tabs_->addTab(table(kernel_model_), QStringLiteral("GPU kernels"));
  // Gradients: the parameter kind × layer heat map of two training steps.
  auto* grad = new QWidget;
  auto* grad_layout = new QVBoxLayout(grad);
  grad_layout->setContentsMargins(4, 4, 4, 4);
  gradient_caption_ = new QLabel;
  gradient_caption_->setWordWrap(true);
  grad_layout->addWidget(gradient_caption_);
  gradient_view_ = new QTableView;
  gradient_view_->setModel(gradient_model_);
  gradient_view_->setEditTriggers(QAbstractItemView::NoEditTriggers);
  gradient_view_->setSelectionMode(QAbstractItemView::SingleSelection);
  gradient_view_->setShowGrid(false);
  gradient_view_->horizontalHeader()->setDefaultSectionSize(
      gradient_view_->fontMetrics().horizontalAdvance(QStringLiteral("0.00e-00")) + 8);
  gradient_view_->verticalHeader()->setDefaultSectionSize(gradient_view_->fontMetrics().height() + 4);
  grad_layout->addWidget(gradient_view_, 1);
  const int gi = tabs_->addTab(grad, QStringLiteral("Gradients"));
  Q_ASSERT(gi == kGradientsTab);
  (void)gi;
  tabs_->setTabVisible(kGradientsTab, false);
  // Precision bisect: the ranking of a `dsv4 bisect` report, independent of the traces shown.
  auto* bisect = new QWidget;
  auto* bisect_layout = new QVBoxLayout(bisect);
  bisect_layout->setContentsMargins(4, 4, 4, 4);
  bisect_caption_ = new QLabel;
  bisect_caption_->setWordWrap(true);
  bisect_layout->addWidget(bisect_caption_);
  auto* bisect_view = table(bisect_model_);
  bisect_view->horizontalHeader()->setSectionResizeMode(BisectModel::Sites, QHeaderView::ResizeToContents);
  bisect_layout->addWidget(bisect_view, 1);
  const int bi = tabs_->addTab(bisect, QStringLiteral("Precision bisect"));
  Q_ASSERT(bi == kBisectTab);
  (void)bi;
  tabs_->setTabVisible(kBisectTab, false);

  auto* right = new QSplitter(Qt::Vertical);
  right->addWidget(chart_);
  right->addWidget(tabs_);
  right->setSizes({520, 420});
  auto* bottom = new QSplitter(Qt::Horizontal);
  bottom->addWidget(detail_);
  bottom->addWidget(right);
  bottom->setSizes({820, 680});
  // The banner: what the navigator found, above the overview (comparison mode).
  banner_ = new QLabel;
  banner_->setObjectName(QStringLiteral("divergence-banner"));
  banner_->setWordWrap(true);
  banner_->setTextFormat(Qt::RichText);
  // Palettes, not style sheets: a style sheet costs the first paint tens of milliseconds.
  auto tint = [](QWidget* w, QColor c) {
    QPalette pal = w->palette();
    pal.setColor(QPalette::Window, c);
    w->setPalette(pal);
    w->setAutoFillBackground(true);
  };
  tint(banner_, QColor(0xff, 0xf4, 0xe5));
  banner_->setContentsMargins(6, 3, 6, 3);
  banner_->hide();
  // A failed load of two traces: the problem, and a way on.
  problem_ = new QWidget;
  problem_->setObjectName(QStringLiteral("load-problem"));
  tint(problem_, QColor(0xfd, 0xec, 0xea));
  auto* problem_layout = new QHBoxLayout(problem_);
  problem_layout->setContentsMargins(6, 3, 6, 3);
  problem_text_ = new QLabel;
  problem_text_->setWordWrap(true);
  problem_text_->setTextInteractionFlags(Qt::TextSelectableByMouse);
  problem_layout->addWidget(problem_text_, 1);
  open_a_ = new QPushButton;
  open_b_ = new QPushButton;
  compare_anyway_ = new QPushButton(QStringLiteral("Compare anyway"));
  compare_anyway_->setToolTip(
      QStringLiteral("Allow a model mismatch (File ▸ Allow model mismatch) and load again"));
  for (QPushButton* b : {open_a_, open_b_, compare_anyway_}) problem_layout->addWidget(b);
  connect(open_a_, &QPushButton::clicked, this, [this] { openTraces(open_a_->property("path").toString()); });
  connect(open_b_, &QPushButton::clicked, this, [this] { openTraces(open_b_->property("path").toString()); });
  connect(compare_anyway_, &QPushButton::clicked, this, [this] {
    allow_mismatch_->setChecked(true);
    openTraces(open_a_->property("path").toString(), open_b_->property("path").toString());
  });
  problem_->hide();
  auto* top = new QWidget;
  auto* top_layout = new QVBoxLayout(top);
  top_layout->setContentsMargins(0, 0, 0, 0);
  top_layout->setSpacing(0);
  top_layout->addWidget(problem_);
  top_layout->addWidget(banner_);
  top_layout->addWidget(heatmap_, 1);
  auto* main = new QSplitter(Qt::Vertical);
  main->addWidget(top);
  main->addWidget(bottom);
  main->setSizes({380, 570});
  setCentralWidget(main);
}

void MainWindow::buildActions() {
  QMenu* file = menuBar()->addMenu(QStringLiteral("&File"));
  QAction* open = file->addAction(QStringLiteral("&Open…"), this, [this] { openDialog(false); });
  open->setShortcut(QKeySequence::Open);
  file->addAction(QStringLiteral("Open &candidate (B)…"), this, [this] { openDialog(true); });
  recent_menu_ = file->addMenu(QStringLiteral("Open &recent"));
  reload_ = file->addAction(QStringLiteral("&Reload"), this, [this] {
    if (doc_->lastRequest().path_a.isEmpty()) return;
    // Keep the selected cell across the reload.
    if (heatmap_->selectedRow() >= 0 && heatmap_model_->isTokenAxis())
      selectWhenLoaded(seq_, heatmap_->selectedRow(), heatmap_->selectedColumn());
    open_timer_.start();
    first_paint_ms_ = load_ms_ = -1;
    setLoadingUi(true);
    doc_->reload();
  });
  reload_->setShortcut(QKeySequence::Refresh);
  reload_->setToolTip(
      QStringLiteral("Read the files again (a trace still being written shows its new steps)"));
  // A recording that grows (or finishes) is read again by itself, keeping the selected cell.
  follow_ = file->addAction(QStringLiteral("&Follow the recording"));
  follow_->setCheckable(true);
  follow_->setToolTip(QStringLiteral(
      "Read the files again whenever they change on disk (a trace still being written shows its new steps)"));
  connect(follow_, &QAction::toggled, doc_, [this](bool on) { doc_->setFollow(on); });
  follow_->setChecked(true);
  connect(doc_, &TraceDocument::filesChanged, this, [this] {
    if (doc_->loading()) return;
    reload_->trigger();
    status_->setText(QStringLiteral("The files changed on disk: reading them again"));
  });
  allow_mismatch_ = file->addAction(QStringLiteral("Allow &model mismatch"));
  allow_mismatch_->setCheckable(true);
  allow_mismatch_->setToolTip(QStringLiteral(
      "Compare traces recorded with different weights (the next load; dsv4 diff --allow-model-mismatch)"));
  connect(allow_mismatch_, &QAction::toggled, doc_, &TraceDocument::setAllowModelMismatch);
  file->addAction(QStringLiteral("Open &bisect report…"), this, [this] {
    const QString p = QFileDialog::getOpenFileName(this, QStringLiteral("Open a dsv4 bisect report"), {},
                                                   QStringLiteral("JSON (*.json);;All files (*)"));
    if (p.isEmpty()) return;
    if (const QString error = openBisect(p); !error.isEmpty())
      QMessageBox::warning(this, QStringLiteral("Bisect report"), error);
  });
  file->addSeparator();
  QMenu* exp = file->addMenu(QStringLiteral("&Export"));
  exp->addAction(QStringLiteral("Heatmap as PNG…"), this, [this] {
    const QString p =
        QFileDialog::getSaveFileName(this, QStringLiteral("Export heatmap"), QStringLiteral("heatmap.png"),
                                     QStringLiteral("PNG images (*.png)"));
    if (!p.isEmpty()) exportHeatmapPng(p);
  });
  exp->addAction(QStringLiteral("Log-prob chart as PNG…"), this, [this] {
    const QString p =
        QFileDialog::getSaveFileName(this, QStringLiteral("Export chart"), QStringLiteral("logprobs.png"),
                                     QStringLiteral("PNG images (*.png)"));
    if (!p.isEmpty()) exportChartPng(p);
  });
  export_json_ = exp->addAction(QStringLiteral("Diff report as JSON…"), this, [this] {
    const QString p = QFileDialog::getSaveFileName(
        this, QStringLiteral("Export report"), QStringLiteral("diff.json"), QStringLiteral("JSON (*.json)"));
    if (!p.isEmpty()) exportReportJson(p);
  });
  export_csv_ = exp->addAction(QStringLiteral("Diff report as CSV (directory)…"), this, [this] {
    const QString p = QFileDialog::getExistingDirectory(this, QStringLiteral("Export report as CSV into"));
    if (!p.isEmpty()) exportReportCsv(p);
  });
  file->addSeparator();
  QAction* quit = file->addAction(QStringLiteral("&Quit"), this, &QWidget::close);
  quit->setShortcut(QKeySequence::Quit);

  QMenu* view = menuBar()->addMenu(QStringLiteral("&View"));
  QAction* zin = view->addAction(QStringLiteral("Zoom &in"), heatmap_, &HeatmapView::zoomIn);
  zin->setShortcut(QKeySequence::ZoomIn);
  QAction* zout = view->addAction(QStringLiteral("Zoom &out"), heatmap_, &HeatmapView::zoomOut);
  zout->setShortcut(QKeySequence::ZoomOut);
  QAction* fit = view->addAction(QStringLiteral("&Fit all tokens"), heatmap_, &HeatmapView::fitToWidth);
  fit->setShortcut(QKeySequence(Qt::CTRL | Qt::Key_0));
  view->addSeparator();
  QAction* diff_only = view->addAction(QStringLiteral("Log-prob chart: B − A &only"));
  diff_only->setCheckable(true);
  connect(diff_only, &QAction::toggled, chart_, &LogprobChart::setDifferenceOnly);

  QMenu* go = menuBar()->addMenu(QStringLiteral("&Go"));
  first_div_ = go->addAction(QStringLiteral("First &divergence"), this, [this] {
    if (!goToFirstDivergence()) status_->setText(QStringLiteral("No divergence to go to."));
  });
  first_div_->setShortcut(QKeySequence(Qt::CTRL | Qt::Key_D));
  first_div_->setToolTip(QStringLiteral("Select the cell of the first differing tensor (Ctrl+D)"));
  next_div_ = go->addAction(QStringLiteral("&Next divergence"), this, [this] {
    if (!nextDivergence()) status_->setText(QStringLiteral("No further divergence in the list."));
  });
  next_div_->setShortcut(QKeySequence(Qt::Key_F3));
  next_div_->setToolTip(QStringLiteral("The next divergence of the navigator's list (F3)"));
  prev_div_ = go->addAction(QStringLiteral("&Previous divergence"), this, [this] {
    if (!previousDivergence()) status_->setText(QStringLiteral("No earlier divergence in the list."));
  });
  prev_div_->setShortcut(QKeySequence(Qt::SHIFT | Qt::Key_F3));
  prev_div_->setToolTip(QStringLiteral("The previous divergence of the navigator's list (Shift+F3)"));
  next_div_->setEnabled(false);
  prev_div_->setEnabled(false);
  first_div_->setEnabled(false);
}

void MainWindow::buildToolbar() {
  QToolBar* tb = addToolBar(QStringLiteral("View"));
  tb->setObjectName(QStringLiteral("view-toolbar"));
  tb->setMovable(false);
  tb->addWidget(new QLabel(QStringLiteral(" Metric ")));
  metric_combo_ = new QComboBox;
  metric_combo_->setMinimumWidth(200);
  tb->addWidget(metric_combo_);
  connect(metric_combo_, &QComboBox::activated, this,
          [this](int i) { setMetric(Metric(metric_combo_->itemData(i).toInt())); });
  tb->addSeparator();
  threshold_check_ = new QCheckBox(QStringLiteral("Highlight beyond"));
  tb->addWidget(threshold_check_);
  threshold_edit_ = new QLineEdit;
  threshold_edit_->setMaximumWidth(90);
  auto* validator = new QDoubleValidator(threshold_edit_);
  validator->setNotation(QDoubleValidator::ScientificNotation);
  threshold_edit_->setValidator(validator);
  tb->addWidget(threshold_edit_);
  connect(threshold_check_, &QCheckBox::toggled, heatmap_model_, &HeatmapModel::setThresholdEnabled);
  connect(threshold_edit_, &QLineEdit::editingFinished, this, &MainWindow::applyThresholdText);
  tb->addSeparator();
  tb->addWidget(new QLabel(QStringLiteral(" Sequence ")));
  seq_combo_ = new QComboBox;
  seq_combo_->setSizeAdjustPolicy(QComboBox::AdjustToContents);  // request names of a generation
  tb->addWidget(seq_combo_);
  connect(seq_combo_, &QComboBox::activated, this, &MainWindow::setSequence);
  tb->addWidget(new QLabel(QStringLiteral(" Step A ")));
  step_a_ = new QSpinBox;
  tb->addWidget(step_a_);
  tb->addWidget(new QLabel(QStringLiteral(" B ")));
  step_b_ = new QSpinBox;
  tb->addWidget(step_b_);
  auto reopen = [this] {
    const LoadRequest& r = doc_->lastRequest();
    if (r.path_a.isEmpty()) return;
    if (step_a_->value() == r.step_a && (r.path_b.isEmpty() || step_b_->value() == r.step_b)) return;
    openTraces(r.path_a, r.path_b, step_a_->value(), step_b_->value());
  };
  connect(step_a_, &QSpinBox::editingFinished, this, reopen);
  connect(step_b_, &QSpinBox::editingFinished, this, reopen);
  tb->addSeparator();
  tb->addAction(first_div_);
  tb->addAction(prev_div_);
  tb->addAction(next_div_);
  tb->addAction(reload_);
}

QWidget* MainWindow::buildNavigator() {
  auto* w = new QWidget;
  auto* layout = new QVBoxLayout(w);
  layout->setContentsMargins(4, 4, 4, 4);
  layout->setSpacing(4);
  auto* filters = new QHBoxLayout;
  nav_kind_ = new QComboBox;
  nav_kind_->addItem(QStringLiteral("all kinds"), -1);
  for (int k = 0; k < kDivergenceKinds; ++k)
    nav_kind_->addItem(QString::fromUtf8(divergence_kind_name(DivergenceKind(k))), k);
  nav_layer_ = new QComboBox;
  nav_seq_ = new QComboBox;
  nav_layer_->setSizeAdjustPolicy(QComboBox::AdjustToContents);
  nav_seq_->setSizeAdjustPolicy(QComboBox::AdjustToContents);
  nav_kind_->setSizeAdjustPolicy(QComboBox::AdjustToContents);
  filters->addWidget(nav_kind_);
  filters->addWidget(nav_layer_);
  filters->addWidget(nav_seq_);
  filters->addStretch(1);
  layout->addLayout(filters);
  connect(nav_kind_, &QComboBox::activated, this,
          [this](int i) { navigator_model_->setKindFilter(nav_kind_->itemData(i).toInt()); });
  connect(nav_layer_, &QComboBox::activated, this,
          [this](int i) { navigator_model_->setLayerFilter(nav_layer_->itemData(i).toInt()); });
  connect(nav_seq_, &QComboBox::activated, this,
          [this](int i) { navigator_model_->setSeqFilter(nav_seq_->itemData(i).toInt()); });
  navigator_view_ = table(navigator_model_);
  navigator_view_->setSelectionMode(QAbstractItemView::SingleSelection);
  navigator_view_->setSortingEnabled(true);
  navigator_view_->horizontalHeader()->setSortIndicator(NavigatorModel::Severity, Qt::AscendingOrder);
  navigator_view_->horizontalHeader()->setSectionResizeMode(QHeaderView::ResizeToContents);
  // Columns sized to the rows in view and a screenful beyond, not to all of them: measuring every row
  // of thousands of flips stalls the window for tens of ms each time the list changes.
  navigator_view_->horizontalHeader()->setResizeContentsPrecision(64);
  layout->addWidget(navigator_view_, 1);
  connect(navigator_view_, &QTableView::clicked, this,
          [this](const QModelIndex& i) { goToDivergence(i.row()); });
  connect(navigator_view_, &QTableView::activated, this,
          [this](const QModelIndex& i) { goToDivergence(i.row()); });
  connect(navigator_model_, &NavigatorModel::currentChanged, this, [this](int row) {
    if (row < 0) {
      navigator_view_->clearSelection();
      return;
    }
    navigator_view_->selectRow(row);
    navigator_view_->scrollTo(navigator_model_->index(row, 0));
  });
  return w;
}

bool MainWindow::selectLayerRow(int row) {
  const Dataset& d = doc_->data();
  if (!d.report || row < 0 || row >= int(d.report->layers.size())) return false;
  const int layer = d.report->layers[size_t(row)].layer;
  if (d.divergences)
    for (const Divergence& v : d.divergences->items)
      if (v.kind == DivergenceKind::FirstTensor && v.layer == layer) {
        if (v.seq != seq_) setSequence(v.seq);
        selectCell(v.cell_layer, v.token);
        return true;
      }
  selectCell(layer, std::max(heatmap_->selectedColumn(), 0));
  return true;
}

bool MainWindow::selectTensorRow(int row) {
  const Dataset& d = doc_->data();
  if (!d.report || row < 0 || row >= int(d.report->tensors.size())) return false;
  const TensorDiff& t = d.report->tensors[size_t(row)];
  if (t.first_digest_row < 0) {
    status_->setText(QStringLiteral("%1: bit-equal in both traces").arg(QString::fromStdString(t.name)));
    if (t.layer >= 0) selectCell(t.layer, std::max(heatmap_->selectedColumn(), 0));
    return t.layer >= 0;
  }
  const int seq = int(std::max<int64_t>(t.first_digest_seq, 0));
  const Cell c = digest_cell(*d.summary, d.seq_tokens(seq), seq, t.layer, t.name, t.first_digest_row);
  if (c.seq != seq_) setSequence(c.seq);
  selectCell(c.layer, c.token);
  status_->setText(QStringLiteral("%1 (layer %2): first differing row %3, token %4")
                       .arg(QString::fromStdString(t.name))
                       .arg(t.layer)
                       .arg(t.first_digest_row)
                       .arg(c.token));
  return true;
}

bool MainWindow::goToDivergence(int row) {
  const Divergence* d = navigator_model_->item(row);
  if (!d) return false;
  navigator_model_->setCurrent(row);
  if (d->seq != seq_) setSequence(d->seq);
  selectCell(d->cell_layer, d->token);
  status_->setText(QStringLiteral("Divergence %1 of %2: %3")
                       .arg(row + 1)
                       .arg(navigator_model_->rowCount())
                       .arg(navigator_model_->data(navigator_model_->index(row, 0), Qt::ToolTipRole)
                                .toString()
                                .replace(QLatin1Char(0x0a), QStringLiteral("; "))));
  return true;
}

bool MainWindow::nextDivergence() {
  const int row = navigator_model_->current() + 1;
  return row < navigator_model_->rowCount() && goToDivergence(row);
}

bool MainWindow::previousDivergence() {
  const int row = navigator_model_->current() - 1;
  return row >= 0 && goToDivergence(row);
}

void MainWindow::markFirstDivergence() {
  const DivergenceList* l = navigator_model_->list();
  if (l && l->has_first_divergence && l->first_cell.seq == seq_)
    heatmap_->setMarkedCell(l->first_cell.layer, int(l->first_cell.token));
  else
    heatmap_->setMarkedCell(-1, -1);
}

void MainWindow::onDivergencesLoaded() {
  markFirstDivergence();
  const QString text = navigator_model_->banner();
  banner_->setText(text);
  banner_->setVisible(!text.isEmpty());
  const int n = navigator_model_->list() ? int(navigator_model_->list()->items.size()) : 0;
  tabs_->setTabText(kDivergencesTab, QStringLiteral("Divergences (%1)").arg(n));
  next_div_->setEnabled(n > 0);
  prev_div_->setEnabled(n > 0);
}

void MainWindow::updateGradientsTab() {
  const bool on = gradient_model_->available();
  tabs_->setTabVisible(kGradientsTab, on);
  gradient_caption_->setText(gradient_model_->caption());
  if (on)
    tabs_->setTabText(
        kGradientsTab,
        QStringLiteral("Gradients (%1 differ)").arg(gradient_model_->training()->params_differing));
}

void MainWindow::setLoadingUi(bool loading) {
  // A load that starts or ends ends the stall measurement of the one before (it starts again at the
  // new load's first painted frame).
  stalls_.stop();
  progress_->setVisible(loading);
  cancel_->setVisible(loading);
  if (loading) progress_->setRange(0, 0);
}

void MainWindow::openTraces(const QString& a, const QString& b, int step_a, int step_b) {
  problem_->hide();
  metric_chosen_ = wanted_metric_.has_value();  // --metric given before the files
  open_timer_.start();
  first_paint_ms_ = load_ms_ = -1;
  setLoadingUi(true);
  status_->setText(QStringLiteral("Opening %1…").arg(a));
  doc_->open(a, b, step_a, step_b);
  if (interactive_) addRecent(a, b);
  const QString title =
      b.isEmpty() ? QFileInfo(a).fileName()
                  : QStringLiteral("%1 vs %2").arg(QFileInfo(a).fileName(), QFileInfo(b).fileName());
  setWindowTitle(QStringLiteral("%1 — dsv4-view").arg(title));
}

QString MainWindow::openBisect(const QString& path) {
  if (const QString error = bisect_model_->load(path); !error.isEmpty()) return error;
  bisect_caption_->setText(bisect_model_->caption());
  tabs_->setTabVisible(kBisectTab, true);
  tabs_->setCurrentIndex(kBisectTab);
  return {};
}

void MainWindow::openDialog(bool as_candidate) {
  const QString filter = QStringLiteral("dsv4 traces (*.h5 *.h5.incomplete);;All files (*)");
  if (as_candidate) {
    const QString a = doc_->lastRequest().path_a;
    if (a.isEmpty()) return openDialog(false);
    const QString b =
        QFileDialog::getOpenFileName(this, QStringLiteral("Open the candidate trace (B)"), {}, filter);
    if (!b.isEmpty()) openTraces(a, b);
    return;
  }
  const QStringList files = QFileDialog::getOpenFileNames(
      this, QStringLiteral("Open one trace, or two to compare (A = reference)"), {}, filter);
  if (files.size() == 1) openTraces(files[0]);
  if (files.size() >= 2) openTraces(files[0], files[1]);
}

void MainWindow::addRecent(const QString& a, const QString& b) {
  QSettings s;
  QStringList list = s.value(QStringLiteral("recent")).toStringList();
  const QString entry = b.isEmpty() ? a : a + '\n' + b;
  list.removeAll(entry);
  list.prepend(entry);
  while (list.size() > kMaxRecent) list.removeLast();
  s.setValue(QStringLiteral("recent"), list);
  rebuildRecentMenu();
}

void MainWindow::rebuildRecentMenu() {
  recent_menu_->clear();
  const QStringList list =
      interactive_ ? QSettings().value(QStringLiteral("recent")).toStringList() : QStringList();
  for (const QString& entry : list) {
    const QStringList paths = entry.split('\n');
    QString text = QFileInfo(paths[0]).fileName();
    if (paths.size() > 1) text += QStringLiteral(" vs ") + QFileInfo(paths[1]).fileName();
    QAction* act =
        recent_menu_->addAction(text, this, [this, paths] { openTraces(paths[0], paths.value(1)); });
    act->setToolTip(paths.join(QStringLiteral(" vs ")));
  }
  recent_menu_->setEnabled(!list.isEmpty());
}

void MainWindow::dragEnterEvent(QDragEnterEvent* e) {
  if (e->mimeData()->hasUrls()) e->acceptProposedAction();
}

void MainWindow::dropEvent(QDropEvent* e) {
  QStringList files;
  for (const QUrl& u : e->mimeData()->urls())
    if (u.isLocalFile()) files << u.toLocalFile();
  if (files.isEmpty()) return;
  e->acceptProposedAction();
  if (files.size() == 1)
    openTraces(files[0]);
  else
    openTraces(files[0], files[1]);
}

void MainWindow::closeEvent(QCloseEvent* e) {
  doc_->cancel();
  e->accept();
}

void MainWindow::updateMetricControls() {
  metric_combo_->clear();
  for (Metric m : heatmap_model_->availableMetrics())
    metric_combo_->addItem(QString::fromUtf8(metric_info(m).label), int(m));
  metric_combo_->setCurrentIndex(metric_combo_->findData(int(heatmap_model_->metric())));
  threshold_edit_->setText(QString::number(heatmap_model_->threshold(), 'g', 4));
}

void MainWindow::applyThresholdText() {
  bool ok = false;
  const double v = threshold_edit_->text().toDouble(&ok);
  if (ok) heatmap_model_->setThreshold(v);
}

bool MainWindow::setMetric(Metric m) {
  metric_chosen_ = true;
  if (!doc_->data().summary) {
    wanted_metric_ = m;
    return true;
  }
  const auto avail = heatmap_model_->availableMetrics();
  if (std::find(avail.begin(), avail.end(), m) == avail.end()) return false;
  const int row = heatmap_->selectedRow(), col = heatmap_->selectedColumn();
  const bool was_tokens = heatmap_model_->isTokenAxis();
  heatmap_model_->setMetric(m);
  metric_combo_->setCurrentIndex(metric_combo_->findData(int(m)));
  threshold_edit_->setText(QString::number(heatmap_model_->threshold(), 'g', 4));
  if (row >= 0 && was_tokens && heatmap_model_->isTokenAxis()) heatmap_->select(row, col);
  return true;
}

void MainWindow::setSequence(int seq) {
  if (seq < 0 || seq >= doc_->data().seq_count()) return;
  seq_ = seq;
  seq_combo_->setCurrentIndex(seq);
  heatmap_model_->setSeq(seq);
  token_model_->setSeq(seq);
  markFirstDivergence();
  heatmap_->clearSelection();
  chart_->setSelectedToken(-1);
  detail_->setDetail(nullptr);
}

void MainWindow::selectCell(int layer, int64_t token) {
  if (heatmap_model_->isTokenAxis()) {
    heatmap_->select(layer, int(token));  // emits cellSelected → detail request
    return;
  }
  user_selected_ = true;
  chart_->setSelectedToken(int(token));
  doc_->requestDetail(seq_, layer, token);
  emit cellSelected(seq_, layer, token);
}

void MainWindow::selectWhenLoaded(int seq, int layer, int64_t token) {
  pending_select_ = PendingCell{seq, layer, token};
}

bool MainWindow::goToFirstDivergence() {
  const Dataset& d = doc_->data();
  if (!d.comparison()) return false;
  if (!d.report) {
    if (!doc_->loading()) return false;
    pending_first_divergence_ = true;
    status_->setText(QStringLiteral("Going to the first divergence once the diff report is computed…"));
    return true;
  }
  const auto cell = first_divergence_cell(
      *d.report, *d.summary, d.seq_tokens(d.report->first_divergence ? d.report->first_divergence->seq : 0));
  if (!cell) return false;
  if (cell->seq != seq_) setSequence(cell->seq);
  selectCell(cell->layer, cell->token);
  const auto& f = *d.report->first_divergence;
  status_->setText(QStringLiteral("First divergence: sequence %1, layer %2, %3, row %4")
                       .arg(f.seq)
                       .arg(f.layer)
                       .arg(QString::fromStdString(f.tensor))
                       .arg(f.row));
  return true;
}

void MainWindow::showEmptyState() {
  metric_combo_->clear();
  seq_combo_->clear();
  threshold_edit_->clear();
  for (QAction* a : {first_div_, next_div_, prev_div_, export_json_, export_csv_}) a->setEnabled(false);
  for (QWidget* w : {static_cast<QWidget*>(metric_combo_), static_cast<QWidget*>(seq_combo_),
                     static_cast<QWidget*>(threshold_check_), static_cast<QWidget*>(threshold_edit_),
                     static_cast<QWidget*>(step_a_), static_cast<QWidget*>(step_b_)})
    w->setEnabled(false);
  banner_->hide();
  detail_->setDetail(nullptr);
  chart_->setSelectedToken(-1);
  tabs_->setTabText(kDivergencesTab, QStringLiteral("Divergences"));
  tabs_->setTabText(kEnvTab, QStringLiteral("Environment"));
  tabs_->setTabText(kKernelsTab, QStringLiteral("GPU kernels"));
  tabs_->setTabVisible(kGradientsTab, false);
  nav_layer_->clear();
  nav_seq_->clear();
}

void MainWindow::onDatasetReset() {
  const Dataset& d = doc_->data();
  if (!d.summary) {
    seq_ = 0;
    user_selected_ = false;
    pending_first_divergence_ = false;
    showEmptyState();
    return;
  }
  for (QWidget* w : {static_cast<QWidget*>(metric_combo_), static_cast<QWidget*>(seq_combo_),
                     static_cast<QWidget*>(threshold_check_), static_cast<QWidget*>(threshold_edit_),
                     static_cast<QWidget*>(step_a_)})
    w->setEnabled(true);
  seq_ = heatmap_model_->seq();
  user_selected_ = false;
  pending_first_divergence_ = false;
  if (wanted_metric_) {
    const auto avail = heatmap_model_->availableMetrics();
    if (std::find(avail.begin(), avail.end(), *wanted_metric_) != avail.end())
      heatmap_model_->setMetric(*wanted_metric_);
    wanted_metric_.reset();
  }
  updateMetricControls();
  seq_combo_->clear();
  for (int s = 0; s < d.seq_count(); ++s)
    seq_combo_->addItem(d.summary && d.summary->prompt_length(s) >= 0
                            ? QStringLiteral("%1: request '%2' (%3 prompt + %4 generated)")
                                  .arg(s)
                                  .arg(QString::fromStdString(d.summary->request_ids[size_t(s)]))
                                  .arg(d.summary->prompt_length(s))
                                  .arg(d.tokens(s) - d.summary->prompt_length(s))
                            : QStringLiteral("%1 (%2 tokens)").arg(s).arg(d.tokens(s)));
  seq_combo_->setCurrentIndex(seq_);
  // The toolbar lays its widgets out below their size hints when the window is narrow: keep the
  // sequence's text whole (the toolbar's extension menu takes what does not fit).
  seq_combo_->setMinimumWidth(seq_combo_->sizeHint().width());
  const LoadSummary& s = *d.summary;
  step_a_->setRange(0, std::max<int>(0, int(s.a.steps.size()) - 1));
  step_a_->setValue(s.a.step);
  step_b_->setEnabled(s.comparison());
  step_b_->setRange(0, s.b ? std::max<int>(0, int(s.b->steps.size()) - 1) : 0);
  step_b_->setValue(s.b ? s.b->step : 0);
  first_div_->setEnabled(s.comparison());
  next_div_->setEnabled(false);
  prev_div_->setEnabled(false);
  // A pair keeps its banner's line from the start, so the overview is not resized (and rendered
  // again) when the divergences arrive.
  banner_->setText(s.comparison() ? QStringLiteral("Looking for divergences (computing the diff report)…")
                                  : QString());
  banner_->setVisible(s.comparison());
  tabs_->setTabText(kDivergencesTab, QStringLiteral("Divergences"));
  tabs_->setTabEnabled(kDivergencesTab, s.comparison());
  if (s.comparison()) {
    tabs_->setCurrentIndex(kDivergencesTab);
  } else if (tabs_->currentIndex() == kDivergencesTab) {
    tabs_->setCurrentIndex(kSummaryTab);
  }
  nav_layer_->clear();
  nav_layer_->addItem(QStringLiteral("all layers"), -1);
  for (int l = 0; l < d.layers(); ++l) nav_layer_->addItem(QStringLiteral("layer %1").arg(l), l);
  nav_seq_->clear();
  nav_seq_->addItem(QStringLiteral("all sequences"), -1);
  for (int q = 0; q < d.seq_count(); ++q) nav_seq_->addItem(QStringLiteral("sequence %1").arg(q), q);
  nav_kind_->setCurrentIndex(0);
  navigator_model_->setLayerFilter(-1);
  navigator_model_->setSeqFilter(-1);
  navigator_model_->setKindFilter(-1);
  export_json_->setEnabled(s.comparison());
  export_csv_->setEnabled(s.comparison());
  heatmap_->setMarkedCell(-1, -1);  // until the divergences of the new dataset arrive
  detail_->setDetail(nullptr);
  chart_->setSelectedToken(-1);
  tabs_->setTabText(kEnvTab, s.comparison()
                                 ? QStringLiteral("Environment (%1 differ)").arg(env_model_->differingRows())
                                 : QStringLiteral("Environment"));
  updateGradientsTab();
  const int kd = kernel_model_->firstDifference();
  tabs_->setTabText(kKernelsTab, kd >= 0 ? QStringLiteral("GPU kernels (differ at #%1)").arg(kd)
                                 : kernel_model_->launches() > 0
                                     ? QStringLiteral("GPU kernels (%1)").arg(kernel_model_->launches())
                                     : QStringLiteral("GPU kernels"));
}

void MainWindow::onLoadFinished() {
  load_ms_ = open_timer_.isValid() ? open_timer_.nsecsElapsed() / 1e6 : -1;
  setLoadingUi(false);
  const Dataset& d = doc_->data();
  int64_t tokens = 0;
  for (int s = 0; s < d.seq_count(); ++s) tokens += d.tokens(s);
  status_->setText(QStringLiteral("Loaded %1: %2 sequence(s), %3 tokens, %4 layers.")
                       .arg(d.comparison() ? QStringLiteral("two traces") : QStringLiteral("one trace"))
                       .arg(d.seq_count())
                       .arg(tokens)
                       .arg(d.layers()));
  // Opening a comparison on the metric that shows where the runs part (default_comparison_metric),
  // unless the user chose one.
  if (d.comparison() && !metric_chosen_) {
    const Metric m = default_comparison_metric(d, seq_);
    if (m != heatmap_model_->metric()) {
      setMetric(m);
      metric_chosen_ = false;
    }
  }
  if (pending_select_) {
    const PendingCell c = *pending_select_;
    pending_select_.reset();
    if (c.seq < d.seq_count() && c.layer < d.layers() && c.token < d.tokens(c.seq)) {
      setSequence(c.seq);
      selectCell(c.layer, c.token);
      return;
    }
  }
  if (user_selected_ || heatmap_->selectedRow() >= 0) return;
  if (d.comparison()) {
    // The most severe item of the navigator, else the first divergence.
    if (!goToDivergence(0)) goToFirstDivergence();
  } else if (const auto [r, c] = heatmap_model_->worstCell(); r >= 0 && heatmap_model_->isTokenAxis()) {
    selectCell(r, c);
  }
}

void MainWindow::onLoadFailed(const LoadError& e) {
  setLoadingUi(false);
  status_->setText(e.message.section('\n', 0, 0));
  const LoadRequest& r = doc_->lastRequest();
  if (e.pair) {
    problem_text_->setText(
        QStringLiteral("<b>%1</b>: %2")
            .arg(error_title(e.kind), e.message.toHtmlEscaped().replace('\n', QStringLiteral("<br>"))));
    open_a_->setText(QStringLiteral("Open A alone (%1)").arg(QFileInfo(r.path_a).fileName()));
    open_a_->setProperty("path", r.path_a);
    open_b_->setText(QStringLiteral("Open B alone (%1)").arg(QFileInfo(r.path_b).fileName()));
    open_b_->setProperty("path", r.path_b);
    compare_anyway_->setVisible(e.details.contains(QStringLiteral("allow a model mismatch")) &&
                                !doc_->allowModelMismatch());
    problem_->show();
  }
  // The title names what is shown: the dataset that stays (a load that failed before its summary
  // leaves the previous one), or nothing.
  if (const auto& s = doc_->data().summary)
    setWindowTitle(QStringLiteral("%1 — dsv4-view")
                       .arg(s->b ? QStringLiteral("%1 vs %2")
                                       .arg(QFileInfo(QString::fromStdString(s->a.path)).fileName(),
                                            QFileInfo(QString::fromStdString(s->b->path)).fileName())
                                 : QFileInfo(QString::fromStdString(s->a.path)).fileName()));
  else
    setWindowTitle(QStringLiteral("dsv4-view"));
  if (!interactive_) return;
  auto* box = new QMessageBox(QMessageBox::Critical, error_title(e.kind), e.message, QMessageBox::Ok, this);
  if (e.details != e.message) box->setDetailedText(e.details);
  box->setAttribute(Qt::WA_DeleteOnClose);
  box->open();
}

void MainWindow::exportHeatmapPng(const QString& path) {
  doc_->exportImage(heatmap_->grab().toImage(), path);
}
void MainWindow::exportChartPng(const QString& path) {
  doc_->exportImage(chart_->grab().toImage(), path);
}
void MainWindow::exportReportJson(const QString& path) {
  doc_->exportReport(path, ExportRequest::Kind::Json);
}
void MainWindow::exportReportCsv(const QString& dir) {
  doc_->exportReport(dir, ExportRequest::Kind::Csv);
}

}  // namespace dsv4::gui
