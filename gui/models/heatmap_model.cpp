#include "gui/models/heatmap_model.h"

#include <algorithm>
#include <cmath>

#include "gui/models/metrics.h"

namespace dsv4::gui {

namespace {

// Cells that differ at all are drawn at least this far up the scale, so a tiny difference is never
// confused with an exact match.
constexpr double kDifferenceFloor = 0.12;

QRgb blend(QRgb c, QRgb d, double w) {  // (1 − w)·c + w·d
  auto mix = [&](int x, int y) { return int(std::lround((1 - w) * x + w * y)); };
  return qRgb(mix(qRed(c), qRed(d)), mix(qGreen(c), qGreen(d)), mix(qBlue(c), qBlue(d)));
}

QString layer_kind(const ModelConfig& c, int layer) {
  QString k;
  const int r = layer < int(c.compress_ratios.size()) ? c.compress_ratios[layer] : 0;
  k = r == 0 ? QStringLiteral("SWA") : QStringLiteral("C%1").arg(r);
  if (c.is_hash_layer(layer)) k += QStringLiteral(" hash");
  return k;
}

}  // namespace

QRgb heat_color(double t) {
  static const QRgb stops[] = {qRgb(0xff, 0xfb, 0xe8), qRgb(0xfe, 0xd9, 0x76), qRgb(0xfd, 0x8d, 0x3c),
                               qRgb(0xe3, 0x1a, 0x1c), qRgb(0x67, 0x00, 0x0d)};
  t = std::clamp(t, 0.0, 1.0) * 4;
  const int i = std::min(int(t), 3);
  return blend(stops[i], stops[i + 1], t - i);
}

QRgb level_color(uint16_t level, uint8_t flags, bool threshold_on) {
  if (level == kLevelNoData) return (flags & kNotLoaded) ? qRgb(0xee, 0xee, 0xf2) : qRgb(0xcf, 0xcf, 0xcf);
  if (flags & kNearTie) return qRgb(0x1f, 0x78, 0xb4);
  const QRgb c = heat_color(double(level) / kLevelMax);
  if (threshold_on && !(flags & kBeyondThreshold)) return blend(c, qRgb(0xff, 0xff, 0xff), 0.78);
  return c;
}

HeatmapModel::HeatmapModel(TraceDocument* doc, QObject* parent) : QAbstractTableModel(parent), doc_(doc) {
  connect(doc_, &TraceDocument::datasetReset, this, [this] {
    // A new mode (first load, or single ↔ comparison) starts on the mode's default metric.
    const bool cmp = doc_->data().comparison();
    const auto avail = availableMetrics();
    if (!mode_ || *mode_ != cmp || std::find(avail.begin(), avail.end(), metric_) == avail.end()) {
      metric_ = cmp ? Metric::MhcDifference : Metric::RouterMargin;
      threshold_ = info().default_threshold;
    }
    mode_ = cmp;
    if (seq_ >= doc_->data().seq_count()) seq_ = 0;
    beginResetModel();
    rebuild();
    endResetModel();
  });
  connect(doc_, &TraceDocument::seqLoaded, this, [this](int seq) {
    if (seq != seq_) return;
    rebuildStrip();
    ++revision_;
    if (cols_ > 0) emit headerDataChanged(Qt::Horizontal, 0, cols_ - 1);
  });
  connect(doc_, &TraceDocument::chunkLoaded, this, [this](int seq, int layer) {
    if (seq != seq_ || layer >= rows_ || cols_ == 0) return;
    const double lo = lo_, hi = hi_;
    countRow(layer);
    rebuildRange();
    if (lo != lo_ || hi != hi_) {
      for (int r = 0; r < rows_; ++r) rebuildLevels(r);
      ++revision_;
      emit dataChanged(index(0, 0), index(rows_ - 1, cols_ - 1));
    } else {
      rebuildLevels(layer);
      ++revision_;
      emit dataChanged(index(layer, 0), index(layer, cols_ - 1));
    }
  });
  connect(doc_, &TraceDocument::reportLoaded, this, [this] {
    if (rows_ == 0 || cols_ == 0) return;
    for (int r = 0; r < rows_; ++r) rebuildFlags(r);
    ++revision_;
    emit dataChanged(index(0, 0), index(rows_ - 1, cols_ - 1));
  });
}

int HeatmapModel::rowCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : rows_;
}
int HeatmapModel::columnCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : cols_;
}

std::vector<Metric> HeatmapModel::availableMetrics() const {
  std::vector<Metric> out;
  if (!doc_->data().summary) return out;
  const bool cmp = doc_->data().comparison();
  for (const auto& m : all_metrics())
    if (cmp ? m.comparison : m.single) out.push_back(m.metric);
  return out;
}

void HeatmapModel::setMetric(Metric m) {
  beginResetModel();
  metric_ = m;
  threshold_ = info().default_threshold;
  rebuild();
  endResetModel();
}

int HeatmapModel::promptBoundary() const {
  const auto& s = doc_->data().summary;
  if (!s || !isTokenAxis()) return -1;
  const int64_t p = s->prompt_length(seq_);
  return p > 0 && p < cols_ ? int(p) : -1;
}

void HeatmapModel::setSeq(int seq) {
  if (seq == seq_ || seq < 0 || seq >= std::max(doc_->data().seq_count(), 1)) return;
  beginResetModel();
  seq_ = seq;
  rebuild();
  endResetModel();
}

void HeatmapModel::setThreshold(double t) {
  if (t == threshold_) return;
  threshold_ = t;
  if (!threshold_on_ || rows_ == 0 || cols_ == 0) return;
  for (int r = 0; r < rows_; ++r) rebuildFlags(r);
  ++revision_;
  emit dataChanged(index(0, 0), index(rows_ - 1, cols_ - 1));
}

void HeatmapModel::setThresholdEnabled(bool on) {
  if (on == threshold_on_) return;
  threshold_on_ = on;
  if (rows_ == 0 || cols_ == 0) return;
  for (int r = 0; r < rows_; ++r) rebuildFlags(r);
  ++revision_;
  emit dataChanged(index(0, 0), index(rows_ - 1, cols_ - 1));
}

float HeatmapModel::value(int row, int col) const {
  const LayerChunk* c = doc_->data().chunk(seq_, row);
  if (!c) return kNoValue;
  const auto& v = c->values[int(metric_)];
  return col >= 0 && col < int(v.size()) ? v[col] : kNoValue;
}

void HeatmapModel::rebuild() {
  const Dataset& d = doc_->data();
  rows_ = d.layers();
  cols_ = 0;
  if (d.summary && seq_ < d.seq_count())
    cols_ = isTokenAxis() ? int(d.tokens(seq_)) : d.summary->a.config.n_routed_experts;
  levels_.assign(size_t(rows_) * cols_, kLevelNoData);
  flags_.assign(size_t(rows_) * cols_, 0);
  row_counts_.assign(size_t(rows_), {});
  for (int r = 0; r < rows_; ++r) countRow(r);
  rebuildRange();
  for (int r = 0; r < rows_; ++r) rebuildLevels(r);
  rebuildStrip();
  ++revision_;
}

void HeatmapModel::countRow(int row) {
  if (row < 0 || row >= int(row_counts_.size())) return;
  LogScaleCounts& c = row_counts_[size_t(row)];
  c = {};
  const LayerChunk* ch = doc_->data().chunk(seq_, row);
  if (!ch || !info().log_scale) return;
  for (float v : ch->values[int(metric_)]) c.add(v);
}

void HeatmapModel::rebuildRange() {
  const MetricInfo& mi = info();
  clipped_ = false;
  if (!mi.log_scale) {
    lo_ = 0;
    hi_ = 1;
    if (metric_ == Metric::ExpertLoad) {
      double m = 1;
      for (int r = 0; r < rows_; ++r)
        for (int c = 0; c < cols_; ++c)
          if (const float v = value(r, c); std::isfinite(v)) m = std::max(m, double(v));
      hi_ = m;
    }
    return;
  }
  LogScaleCounts all;
  for (const auto& c : row_counts_) all.add(c);
  const LogScaleCounts::Range r = all.range(mi.lower_is_worse);
  lo_ = r.lo;
  hi_ = r.hi;
  clipped_ = r.clipped;
}

double HeatmapModel::levelOf(float v) const {
  const MetricInfo& mi = info();
  const bool difference = mi.comparison && !mi.single;  // an exact match is the ideal
  double t = 0;
  if (!mi.log_scale) {
    t = std::clamp((double(v) - lo_) / (hi_ - lo_), 0.0, 1.0);
    if (mi.lower_is_worse) t = 1 - t;
  } else if (mi.lower_is_worse) {
    if (std::isinf(v) && v > 0) return 0;
    if (v <= 0) return 1;
    t = std::clamp((std::log(hi_) - std::log(double(v))) / (std::log(hi_) - std::log(lo_)), 0.0, 1.0);
  } else {
    if (v <= 0) return 0;
    if (std::isinf(v)) return 1;
    t = std::clamp((std::log(double(v)) - std::log(lo_)) / (std::log(hi_) - std::log(lo_)), 0.0, 1.0);
  }
  // Any difference at all is drawn clearly above the pale end (also one below a log scale's ideal end).
  const bool differs = mi.log_scale ? v > 0 : (mi.lower_is_worse ? v < hi_ : v > lo_);
  if (difference && differs) t = kDifferenceFloor + (1 - kDifferenceFloor) * t;
  return t;
}

void HeatmapModel::rebuildLevels(int row) {
  const LayerChunk* ch = doc_->data().chunk(seq_, row);
  uint16_t* lv = levels_.data() + size_t(row) * cols_;
  if (!ch) {
    std::fill(lv, lv + cols_, kLevelNoData);
  } else {
    const auto& v = ch->values[int(metric_)];
    for (int c = 0; c < cols_; ++c) {
      const float x = c < int(v.size()) ? v[c] : kNoValue;
      lv[c] = std::isnan(x) ? kLevelNoData : uint16_t(std::lround(levelOf(x) * kLevelMax));
    }
  }
  rebuildFlags(row);
}

double HeatmapModel::tieThreshold(int row) const {
  if (metric_ != Metric::IndexerMargin && metric_ != Metric::RouterMargin) return kNoValue;
  const bool idx = metric_ == Metric::IndexerMargin;
  if (const LayerDiff* ld = doc_->data().layer_diff(row))
    return idx ? ld->indexer_tie_threshold : ld->routing_tie_threshold;
  if (doc_->data().comparison()) return kNoValue;  // wait for the report's thresholds
  const LayerChunk* ch = doc_->data().chunk(seq_, row);
  return ch ? (idx ? ch->indexer_tie_threshold : ch->router_tie_threshold) : kNoValue;
}

void HeatmapModel::rebuildFlags(int row) {
  const LayerChunk* ch = doc_->data().chunk(seq_, row);
  uint8_t* fl = flags_.data() + size_t(row) * cols_;
  if (!ch) {
    std::fill(fl, fl + cols_, uint8_t(kNotLoaded));
    return;
  }
  const auto& v = ch->values[int(metric_)];
  const double tie = tieThreshold(row);
  const bool lower = info().lower_is_worse;
  for (int c = 0; c < cols_; ++c) {
    const float x = c < int(v.size()) ? v[c] : kNoValue;
    uint8_t f = 0;
    if (!std::isnan(x)) {
      if (threshold_on_ && (lower ? x < threshold_ : x > threshold_)) f |= kBeyondThreshold;
      if (!std::isnan(tie) && x < tie) f |= kNearTie;
    }
    fl[c] = f;
  }
}

void HeatmapModel::rebuildStrip() {
  strip_.clear();
  strip_max_ = strip_min_ = 0;
  const SeqTokens* s = doc_->data().seq_tokens(seq_);
  if (!s || !isTokenAxis()) return;
  strip_.assign(size_t(cols_), kNoValue);
  const bool cmp = doc_->data().comparison();
  for (int c = 0; c < cols_ && c < int(s->logprobs_a.size()); ++c) {
    float v =
        cmp ? (c < int(s->logprobs_b.size()) ? std::fabs(s->logprobs_a[c] - s->logprobs_b[c]) : kNoValue)
            : -s->logprobs_a[c];
    strip_[c] = v;
    if (std::isfinite(v)) strip_max_ = std::max(strip_max_, v);
  }
  // −log-prob of a trained-looking model rarely gets near 0: start the bars below the smallest value.
  if (!cmp) {
    float mn = strip_max_;
    for (float v : strip_)
      if (std::isfinite(v)) mn = std::min(mn, v);
    strip_min_ = std::max(0.0f, mn - 0.1f * (strip_max_ - mn));
  }
}

HeatmapModel::Aggregate HeatmapModel::aggregate(int row, int col0, int col1) const {
  Aggregate a;
  if (row < 0 || row >= rows_) return a;
  col0 = std::max(col0, 0);
  col1 = std::min(col1, cols_);
  const uint16_t* lv = levels_.data() + size_t(row) * cols_;
  const uint8_t* fl = flags_.data() + size_t(row) * cols_;
  int worst = -1;
  uint8_t f = 0;
  for (int c = col0; c < col1; ++c) {
    if (lv[c] != kLevelNoData) worst = std::max(worst, int(lv[c]));
    f |= fl[c];
  }
  a.level = worst < 0 ? kLevelNoData : uint16_t(worst);
  a.flags = f;
  return a;
}

std::pair<int, int> HeatmapModel::worstCell() const {
  std::pair<int, int> best{-1, -1};
  int worst = -1;
  for (int r = 0; r < rows_; ++r)
    for (int c = 0; c < cols_; ++c) {
      const uint16_t l = level(r, c);
      if (l != kLevelNoData && int(l) > worst) worst = l, best = {r, c};
    }
  return best;
}

float HeatmapModel::stripAggregate(int col0, int col1) const {
  float m = kNoValue;
  col0 = std::max(col0, 0);
  col1 = std::min(col1, int(strip_.size()));
  for (int c = col0; c < col1; ++c)
    if (!std::isnan(strip_[c])) m = std::isnan(m) ? strip_[c] : std::max(m, strip_[c]);
  return m;
}

QString HeatmapModel::stripLabel() const {
  return doc_->data().comparison() ? QStringLiteral("|Δ log-prob|") : QStringLiteral("−log-prob");
}

QString HeatmapModel::formatValue(double v) const {
  if (std::isnan(v)) return QStringLiteral("—");
  if (std::isinf(v)) return v > 0 ? QStringLiteral("+∞") : QStringLiteral("−∞");
  if (metric_ == Metric::ExpertLoad) return QString::number(qint64(v));
  if (v == 0) return QStringLiteral("0");
  return QString::number(v, 'g', 4);
}

QString HeatmapModel::rowLabel(int row) const {
  if (!doc_->data().summary) return {};
  return QStringLiteral("%1 %2").arg(row).arg(layer_kind(doc_->data().summary->a.config, row));
}

QString HeatmapModel::cellToolTip(int row, int col) const {
  const Dataset& d = doc_->data();
  if (row < 0 || row >= rows_ || col < 0 || col >= cols_) return {};
  const LayerChunk* ch = d.chunk(seq_, row);
  QString head =
      QStringLiteral("layer %1 (%2)").arg(rowLabel(row).section(' ', 0, 0), rowLabel(row).section(' ', 1));
  if (!isTokenAxis()) {
    const float v = value(row, col);
    double routed = 0;
    for (int c = 0; c < cols_; ++c)
      if (std::isfinite(value(row, c))) routed += value(row, c);
    return QStringLiteral("%1 · expert %2\nexpert load: %3 tokens (%4 % of the routed slots)")
        .arg(head)
        .arg(col)
        .arg(formatValue(v))
        .arg(routed > 0 ? QString::number(100.0 * v / routed, 'f', 1) : QStringLiteral("—"));
  }
  const SeqTokens* s = d.seq_tokens(seq_);
  head += QStringLiteral(" · token %1").arg(col);
  if (s && col < int(s->tokens.size())) head += QStringLiteral(" (id %1)").arg(s->tokens[col]);
  if (!ch) return head + QStringLiteral("\nloading…");
  // The rel-L2 of a token is the largest over the layer's full tensors: name the one it comes from.
  auto source = [&](Metric m) {
    if (m != Metric::TensorRelL2 || col >= int(ch->rel_l2_argmax.size())) return QString();
    const int k = ch->rel_l2_argmax[size_t(col)];
    if (k < 0 || k >= int(ch->rel_l2_tensors.size())) return QString();
    return QStringLiteral(" in %1").arg(QString::fromStdString(ch->rel_l2_tensors[size_t(k)]));
  };
  QStringList lines{head};
  lines << QStringLiteral("%1: %2%3  [%4]")
               .arg(info().label, formatValue(value(row, col)), source(metric_), info().unit);
  for (const auto& m : all_metrics()) {
    if (m.metric == metric_ || m.axis != MetricAxis::Tokens) continue;
    const auto& v = ch->values[int(m.metric)];
    if (v.empty() || col >= int(v.size()) || std::isnan(v[col])) continue;
    const double x = v[col];
    const QString text = std::isinf(x) ? QStringLiteral("+∞") : QString::number(x, 'g', 4);
    lines << QStringLiteral("%1: %2%3").arg(m.label, text, source(m.metric));
  }
  const double tie = tieThreshold(row);
  if (!std::isnan(tie)) lines << QStringLiteral("near-tie threshold: %1").arg(tie, 0, 'g', 3);
  if (d.comparison() && s) {
    const auto names = differing_tensors(s->digests_a, s->digests_b, row, col);
    if (!names.empty()) {
      QStringList n;
      for (const auto& x : names) n << QString::fromStdString(x);
      lines << QStringLiteral("digests differ: %1").arg(n.join(QStringLiteral(", ")));
    }
  }
  if (s && col < int(s->logprobs_a.size())) {
    if (d.comparison() && col < int(s->logprobs_b.size()))
      lines << QStringLiteral("log-prob A %1, B %2")
                   .arg(s->logprobs_a[col], 0, 'g', 6)
                   .arg(s->logprobs_b[col], 0, 'g', 6);
    else
      lines << QStringLiteral("log-prob %1").arg(s->logprobs_a[col], 0, 'g', 6);
  }
  return lines.join('\n');
}

QVariant HeatmapModel::data(const QModelIndex& index, int role) const {
  if (!index.isValid() || index.row() >= rows_ || index.column() >= cols_) return {};
  const int r = index.row(), c = index.column();
  const float v = value(r, c);
  switch (role) {
    case Qt::DisplayRole:
      return std::isnan(v) ? QVariant() : QVariant(formatValue(v));
    case ValueRole:
      return std::isnan(v) ? QVariant() : QVariant(double(v));
    case LevelRole:
      return int(level(r, c));
    case BeyondThresholdRole:
      return bool(flags(r, c) & kBeyondThreshold);
    case NearTieRole:
      return bool(flags(r, c) & kNearTie);
    case Qt::ToolTipRole:
      return cellToolTip(r, c);
    case Qt::BackgroundRole:
      return QColor(color(Aggregate{level(r, c), flags(r, c)}));
    default:
      return {};
  }
}

QVariant HeatmapModel::headerData(int section, Qt::Orientation o, int role) const {
  if (role != Qt::DisplayRole && role != Qt::ToolTipRole) return {};
  if (o == Qt::Vertical) {
    if (section < 0 || section >= rows_) return {};
    return role == Qt::DisplayRole ? rowLabel(section) : QStringLiteral("layer %1").arg(section);
  }
  if (section < 0 || section >= cols_) return {};
  if (!isTokenAxis()) return QStringLiteral("expert %1").arg(section);
  if (role == Qt::DisplayRole) return QString::number(section);
  const SeqTokens* s = doc_->data().seq_tokens(seq_);
  return s && section < int(s->tokens.size())
             ? QStringLiteral("token %1 (id %2)").arg(section).arg(s->tokens[section])
             : QStringLiteral("token %1").arg(section);
}

}  // namespace dsv4::gui
