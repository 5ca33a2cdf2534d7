// The viewer's main window: the heatmap overview with its metric, threshold and zoom controls, the
// detail panel of the selected cell, the log-prob chart, the report, layer, tensor and environment
// tables; File ▸ Open / Recent / drag and drop; loading with progress and cancel on the session's
// worker thread; exports. Interactive mode reports load errors in a dialog; batch mode (screenshots,
// tests) leaves them to the document's loadFailed signal.
#pragma once

#include <QElapsedTimer>
#include <QMainWindow>
#include <optional>

#include "gui/models/bisect_model.h"
#include "gui/models/gradient_model.h"
#include "gui/models/heatmap_model.h"
#include "gui/models/navigator_model.h"
#include "gui/models/table_models.h"
#include "gui/models/trace_document.h"
#include "gui/widgets/stall_monitor.h"

class QAction;
class QCheckBox;
class QComboBox;
class QLabel;
class QLineEdit;
class QMenu;
class QProgressBar;
class QPushButton;
class QSpinBox;
class QTabWidget;
class QTableView;

namespace dsv4::gui {

class DetailPanel;
class HeatmapView;
class LogprobChart;

class MainWindow : public QMainWindow {
  Q_OBJECT
 public:
  explicit MainWindow(bool interactive = true, QWidget* parent = nullptr);

  void openTraces(const QString& a, const QString& b = {}, int step_a = 0, int step_b = 0);
  // Shows a `dsv4 bisect` report in the Precision bisect tab; returns the error message (empty on
  // success; the tab keeps what it showed).
  QString openBisect(const QString& path);
  BisectModel* bisectModel() const { return bisect_model_; }
  // Selects (layer, token) of the current sequence: heatmap, chart marker, detail request.
  void selectCell(int layer, int64_t token);
  void setSequence(int seq);
  // The cell to select when the load in progress (or the next one) finishes, instead of the default
  // (the first divergence; in single-trace mode the worst cell of the metric).
  void selectWhenLoaded(int seq, int layer, int64_t token);
  // Selects the cell of the report's first divergence (switching sequence when needed). When the
  // report is not there yet it is done once it arrives. False when there is nothing to go to.
  bool goToFirstDivergence();
  // Applies a metric if the open dataset offers it, else false. Before the first summary arrives
  // the choice is kept and applied then.
  bool setMetric(Metric m);

  // Exports without dialogs; the work happens on the worker thread (exportDone reports it).
  void exportHeatmapPng(const QString& path);
  void exportChartPng(const QString& path);
  void exportReportJson(const QString& path);
  void exportReportCsv(const QString& dir);

  TraceDocument* document() const { return doc_; }
  HeatmapModel* heatmapModel() const { return heatmap_model_; }
  HeatmapView* heatmapView() const { return heatmap_; }
  DetailPanel* detailPanel() const { return detail_; }
  LogprobChart* chart() const { return chart_; }
  TokenModel* tokenModel() const { return token_model_; }
  SummaryModel* summaryModel() const { return summary_model_; }
  EnvModel* envModel() const { return env_model_; }
  KernelModel* kernelModel() const { return kernel_model_; }
  GradientDiffModel* gradientModel() const { return gradient_model_; }
  QTableView* gradientView() const { return gradient_view_; }
  NavigatorModel* navigatorModel() const { return navigator_model_; }
  QTableView* navigatorView() const { return navigator_view_; }
  QTableView* layerView() const { return layer_view_; }
  QTableView* tensorView() const { return tensor_view_; }
  // Linked views: the cell a row of the Layers / Tensors table stands for (the tensor's first
  // differing row; the layer's first differing tensor, else the selected token), selected.
  bool selectLayerRow(int row);
  bool selectTensorRow(int row);
  QLabel* banner() const { return banner_; }
  QAction* firstDivergenceAction() const { return first_div_; }
  // After a failed load of two traces: the problem and buttons that open A or B alone (and, for a
  // model mismatch, compare anyway). Hidden otherwise.
  QWidget* problemPanel() const { return problem_; }
  QPushButton* openAloneButton(int which) const { return which == 0 ? open_a_ : open_b_; }
  QPushButton* compareAnywayButton() const { return compare_anyway_; }
  // Selects the navigator's row (of the rows shown) and its cell; false when out of range.
  bool goToDivergence(int row);
  bool nextDivergence();      // Go ▸ Next divergence (F3)
  bool previousDivergence();  // Go ▸ Previous divergence (Shift+F3)
  // The tabs. Divergences: the navigator (comparison mode).
  static constexpr int kDivergencesTab = 0, kSummaryTab = 1, kLayersTab = 2, kTensorsTab = 3, kEnvTab = 4,
                       kKernelsTab = 5;
  // The tab index of the Gradients view (shown only for two training steps).
  static constexpr int kGradientsTab = 6;
  // The precision bisect's ranking (shown once a report is opened).
  static constexpr int kBisectTab = 7;
  QProgressBar* progressBar() const { return progress_; }
  QTabWidget* tabs() const { return tabs_; }
  int currentSeq() const { return seq_; }
  // Milliseconds from openTraces to the first painted heatmap frame with data rows, and to the end
  // of the load; −1 until then.
  double firstPaintMs() const { return first_paint_ms_; }
  double loadMs() const { return load_ms_; }
  // The UI thread's longest stall between the first painted frame and the end of the load
  // (StallMonitor), and how many stalls exceeded the 16 ms frame budget.
  const StallMonitor& loadStalls() const { return stalls_; }

 signals:
  void cellSelected(int seq, int layer, int64_t token);

 protected:
  void dragEnterEvent(QDragEnterEvent* e) override;
  void dropEvent(QDropEvent* e) override;
  void closeEvent(QCloseEvent* e) override;

 private:
  void buildActions();
  void buildToolbar();
  void buildCentral();
  void onDatasetReset();
  void onLoadFinished();
  void onLoadFailed(const LoadError& e);
  void updateMetricControls();
  void applyThresholdText();
  void addRecent(const QString& a, const QString& b);
  void rebuildRecentMenu();
  void openDialog(bool as_candidate);
  void setLoadingUi(bool loading);
  void updateGradientsTab();
  QWidget* buildNavigator();
  void onDivergencesLoaded();
  void markFirstDivergence();  // on the heatmap, when it is in the sequence shown
  void showEmptyState();

  bool interactive_;
  TraceDocument* doc_;
  HeatmapModel* heatmap_model_;
  TokenModel* token_model_;
  SummaryModel* summary_model_;
  LayerDiffModel* layer_model_;
  TensorDiffModel* tensor_model_;
  EnvModel* env_model_;
  KernelModel* kernel_model_;
  GradientDiffModel* gradient_model_;
  NavigatorModel* navigator_model_;
  BisectModel* bisect_model_;
  QLabel* bisect_caption_;

  HeatmapView* heatmap_;
  DetailPanel* detail_;
  LogprobChart* chart_;
  QTabWidget* tabs_;
  QTableView* gradient_view_;
  QTableView* navigator_view_;
  QTableView *layer_view_, *tensor_view_;
  QLabel* banner_;
  QWidget* problem_;
  QLabel* problem_text_;
  QPushButton *open_a_, *open_b_, *compare_anyway_;
  QAction* allow_mismatch_;
  QAction* follow_;  // File ▸ Follow the recording (TraceDocument::setFollow)
  QComboBox *nav_layer_, *nav_kind_, *nav_seq_;
  QLabel* gradient_caption_;
  QComboBox* metric_combo_;
  QComboBox* seq_combo_;
  QCheckBox* threshold_check_;
  QLineEdit* threshold_edit_;
  QSpinBox *step_a_, *step_b_;
  QLabel* status_;
  QProgressBar* progress_;
  QPushButton* cancel_;
  QMenu* recent_menu_;
  QAction *reload_, *first_div_, *next_div_, *prev_div_, *export_json_, *export_csv_;

  int seq_ = 0;
  std::optional<Metric> wanted_metric_;
  bool metric_chosen_ = false;  // the user (or --metric) chose the metric since the files were opened
  bool pending_first_divergence_ = false;
  struct PendingCell {
    int seq, layer;
    int64_t token;
  };
  std::optional<PendingCell> pending_select_;
  bool user_selected_ = false;
  QElapsedTimer open_timer_;
  double first_paint_ms_ = -1, load_ms_ = -1;
  StallMonitor stalls_;
};

}  // namespace dsv4::gui
