#include "gui/models/table_models.h"

#include <QLocale>
#include <cmath>
#include <set>

namespace dsv4::gui {

namespace {

QString num(double v, int precision = 6) {
  if (std::isnan(v)) return QStringLiteral("—");
  if (std::isinf(v)) return v > 0 ? QStringLiteral("+∞") : QStringLiteral("−∞");
  return QString::number(v, 'g', precision);
}

QString q(const std::string& s) {
  return QString::fromStdString(s);
}

QVariant right_aligned() {
  return QVariant::fromValue(Qt::Alignment(Qt::AlignRight | Qt::AlignVCenter));
}

const TraceStepInfo* step_info(const TraceInfo& t) {
  for (const auto& s : t.steps)
    if (s.index == t.step) return &s;
  return nullptr;
}

}  // namespace

QColor set_color(SetSide s) {
  switch (s) {
    case SetSide::Common:
      return QColor(0x4d, 0x9a, 0x5a);  // green: selected by both
    case SetSide::OnlyA:
      return QColor(0x2c, 0x6f, 0xbb);  // blue: the reference only
    case SetSide::OnlyB:
      return QColor(0xd9, 0x5f, 0x0e);  // orange: the candidate only
  }
  return {};
}

QString set_label(SetSide s, bool comparison) {
  if (!comparison) return QStringLiteral("selected");
  switch (s) {
    case SetSide::Common:
      return QStringLiteral("common");
    case SetSide::OnlyA:
      return QStringLiteral("only A");
    case SetSide::OnlyB:
      return QStringLiteral("only B");
  }
  return {};
}

// ---- TokenModel ------------------------------------------------------------------------------

TokenModel::TokenModel(TraceDocument* doc, QObject* parent) : QAbstractTableModel(parent), doc_(doc) {
  connect(doc_, &TraceDocument::datasetReset, this, [this] {
    beginResetModel();
    if (seq_ >= doc_->data().seq_count()) seq_ = 0;
    endResetModel();
  });
  connect(doc_, &TraceDocument::seqLoaded, this, [this](int seq) {
    if (seq != seq_) return;
    beginResetModel();
    endResetModel();
  });
}

const SeqTokens* TokenModel::tokens() const {
  return doc_->data().seq_tokens(seq_);
}

void TokenModel::setSeq(int seq) {
  if (seq == seq_) return;
  beginResetModel();
  seq_ = seq;
  endResetModel();
}

int TokenModel::rowCount(const QModelIndex& parent) const {
  const SeqTokens* s = tokens();
  return parent.isValid() || !s ? 0 : int(s->logprobs_a.size());
}

int TokenModel::columnCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : (comparison() ? 6 : 3);
}

QVariant TokenModel::data(const QModelIndex& index, int role) const {
  const SeqTokens* s = tokens();
  if (!index.isValid() || !s || index.row() >= rowCount()) return {};
  const int t = index.row();
  if (role == Qt::TextAlignmentRole) return right_aligned();
  if (role != Qt::DisplayRole && role != Qt::EditRole) return {};
  const double a = s->logprobs_a[t];
  const double b = t < int(s->logprobs_b.size()) ? s->logprobs_b[t] : NAN;
  switch (index.column()) {
    case Position:
      return t;
    case NextToken:
      return t + 1 < int(s->tokens.size()) ? QVariant(s->tokens[t + 1]) : QVariant();
    case LogprobA:
      return a;
    case LogprobB:
      return b;
    case AbsDiff:
      return std::fabs(a - b);
    case Ratio:
      return std::exp(b - a);
    default:
      return {};
  }
}

QVariant TokenModel::headerData(int section, Qt::Orientation o, int role) const {
  if (role != Qt::DisplayRole || o != Qt::Horizontal)
    return QAbstractTableModel::headerData(section, o, role);
  static const char* names[] = {"position", "next token", "log p A", "log p B", "|Δ|", "p_B / p_A"};
  if (section < 0 || section >= columnCount()) return {};
  if (!comparison() && section == LogprobA) return QStringLiteral("log p");
  return QString::fromUtf8(names[section]);
}

// ---- SummaryModel ----------------------------------------------------------------------------

SummaryModel::SummaryModel(TraceDocument* doc, QObject* parent) : QAbstractTableModel(parent), doc_(doc) {
  auto reset = [this] {
    beginResetModel();
    rebuild();
    endResetModel();
  };
  connect(doc_, &TraceDocument::datasetReset, this, reset);
  connect(doc_, &TraceDocument::reportLoaded, this, reset);
  connect(doc_, &TraceDocument::loadFinished, this, reset);
}

void SummaryModel::rebuild() {
  lines_.clear();
  const Dataset& d = doc_->data();
  if (!d.summary) return;
  auto add = [this](const QString& k, const QString& v) { lines_.emplace_back(k, v); };
  const LoadSummary& s = *d.summary;
  int64_t tokens = 0;
  for (auto t : s.seq_lengths) tokens += t;
  const TraceStepInfo* sa = step_info(s.a);
  add(QStringLiteral("trace A"), q(s.a.path));
  if (s.b) add(QStringLiteral("trace B"), q(s.b->path));
  add(QStringLiteral("step A"), QStringLiteral("%1 (%2, profile %3)")
                                    .arg(s.a.step)
                                    .arg(sa ? q(sa->kind) : QString(), sa ? q(sa->profile) : QString()));
  if (s.b) {
    const TraceStepInfo* sb = step_info(*s.b);
    add(QStringLiteral("step B"), QStringLiteral("%1 (%2, profile %3)")
                                      .arg(s.b->step)
                                      .arg(sb ? q(sb->kind) : QString(), sb ? q(sb->profile) : QString()));
  }
  add(QStringLiteral("sequences"), QString::number(s.seq_lengths.size()));
  add(QStringLiteral("tokens"), QString::number(tokens));
  add(QStringLiteral("layers"), QString::number(s.layers));
  if (!s.b) {
    add(QStringLiteral("producer"), q(s.a.producer));
    add(QStringLiteral("created"), q(s.a.created));
    add(QStringLiteral("model digest"), q(s.a.model_digest));
    add(QStringLiteral("file size"), QLocale::c().formattedDataSize(s.a.file_bytes));
    add(QStringLiteral("steps in file"), QString::number(s.a.steps.size()));
    return;
  }
  if (!d.report) {
    add(QStringLiteral("diff report"), d.complete ? QStringLiteral("—") : QStringLiteral("computing…"));
    return;
  }
  const DiffReport& r = *d.report;
  add(QStringLiteral("model digests"),
      r.model_mismatch ? QStringLiteral("differ: %1 vs %2").arg(q(r.model_digest_a), q(r.model_digest_b))
                       : QStringLiteral("equal (%1)").arg(q(r.model_digest_a)));
  if (r.first_divergence) {
    const auto& f = *r.first_divergence;
    add(QStringLiteral("first divergence"),
        QStringLiteral("seq %1, layer %2, %3, row %4").arg(f.seq).arg(f.layer).arg(q(f.tensor)).arg(f.row));
  } else {
    add(QStringLiteral("first divergence"), QStringLiteral("none: every digest is equal"));
  }
  add(QStringLiteral("KL k1"), num(r.k1));
  add(QStringLiteral("KL k3"), num(r.k3));
  add(QStringLiteral("ratio mean"), num(r.ratio_mean));
  add(QStringLiteral("ratio min"), num(r.ratio_min));
  add(QStringLiteral("ratio max"), num(r.ratio_max));
  add(QStringLiteral("ratio outside [0.8, 1.25]"), num(r.ratio_outside));
  add(QStringLiteral("|Δ log-prob| mean"), num(r.logprob_abs_mean));
  add(QStringLiteral("|Δ log-prob| max"), num(r.logprob_abs_max));
  int64_t idx_tie = 0, idx_conf = 0, rt_tie = 0, rt_conf = 0;
  for (const auto& l : r.layers) {
    idx_tie += l.indexer_tie_flips, idx_conf += l.indexer_confident_flips;
    rt_tie += l.routing_tie_flips, rt_conf += l.routing_confident_flips;
  }
  add(QStringLiteral("indexer flips (tie / confident)"),
      QStringLiteral("%1 / %2").arg(idx_tie).arg(idx_conf));
  add(QStringLiteral("routing flips (tie / confident)"), QStringLiteral("%1 / %2").arg(rt_tie).arg(rt_conf));
  add(QStringLiteral("tie rule"), QStringLiteral("%1, %2").arg(q(r.tie_rule), num(r.tie_threshold)));
  int64_t differing = 0;
  for (const auto& t : r.tensors) differing += t.rows_differing > 0;
  add(QStringLiteral("tensors differing"), QStringLiteral("%1 of %2").arg(differing).arg(r.tensors.size()));
  if (!r.unmatched.empty()) add(QStringLiteral("unmatched records"), QString::number(r.unmatched.size()));
}

int SummaryModel::rowCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : int(lines_.size());
}
int SummaryModel::columnCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : 2;
}

QVariant SummaryModel::data(const QModelIndex& index, int role) const {
  if (!index.isValid() || index.row() >= int(lines_.size())) return {};
  if (role != Qt::DisplayRole && role != Qt::ToolTipRole) return {};
  const auto& l = lines_[index.row()];
  return index.column() == 0 ? l.first : l.second;
}

QVariant SummaryModel::headerData(int section, Qt::Orientation o, int role) const {
  if (role != Qt::DisplayRole || o != Qt::Horizontal)
    return QAbstractTableModel::headerData(section, o, role);
  return section == 0 ? QStringLiteral("quantity") : section == 1 ? QStringLiteral("value") : QVariant();
}

QString SummaryModel::value(const QString& key) const {
  for (const auto& l : lines_)
    if (l.first == key) return l.second;
  return {};
}

// ---- LayerDiffModel --------------------------------------------------------------------------

LayerDiffModel::LayerDiffModel(TraceDocument* doc, QObject* parent) : QAbstractTableModel(parent), doc_(doc) {
  auto reset = [this] {
    beginResetModel();
    endResetModel();
  };
  connect(doc_, &TraceDocument::datasetReset, this, reset);
  connect(doc_, &TraceDocument::reportLoaded, this, reset);
}

namespace {
const char* kLayerColumns[] = {"layer",
                               "ratio",
                               "overlap mean",
                               "overlap min",
                               "indexer flips tie/conf",
                               "routing exact",
                               "routing Jaccard",
                               "routing flips tie/conf",
                               "mHC comb max",
                               "same-selection share",
                               "rows out differing"};
constexpr int kLayerColumnCount = 11;
}  // namespace

int LayerDiffModel::rowCount(const QModelIndex& parent) const {
  const auto& r = doc_->data().report;
  return parent.isValid() || !r ? 0 : int(r->layers.size());
}
int LayerDiffModel::columnCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : kLayerColumnCount;
}

QVariant LayerDiffModel::data(const QModelIndex& index, int role) const {
  const auto& r = doc_->data().report;
  if (!index.isValid() || !r || index.row() >= int(r->layers.size())) return {};
  if (role == Qt::TextAlignmentRole) return right_aligned();
  if (role != Qt::DisplayRole) return {};
  const LayerDiff& l = r->layers[index.row()];
  switch (index.column()) {
    case 0:
      return l.layer;
    case 1:
      return l.compress_ratio;
    case 2:
      return l.has_indexer ? QVariant(l.indexer_overlap_mean) : QVariant();
    case 3:
      return l.has_indexer ? QVariant(l.indexer_overlap_min) : QVariant();
    case 4:
      return l.has_indexer
                 ? QVariant(QStringLiteral("%1 / %2").arg(l.indexer_tie_flips).arg(l.indexer_confident_flips))
                 : QVariant();
    case 5:
      return l.routing_exact;
    case 6:
      return l.routing_jaccard;
    case 7:
      return QStringLiteral("%1 / %2%3")
          .arg(l.routing_tie_flips)
          .arg(l.routing_confident_flips)
          .arg(l.hash_disagreement ? QStringLiteral(" (hash layer disagrees!)") : QString());
    case 8:
      return l.mhc_comb_max_abs;
    case 9:
      return l.same_selection_share;
    case 10:
      return QStringLiteral("%1 / %2").arg(l.rows_out_differing).arg(l.rows);
    default:
      return {};
  }
}

QVariant LayerDiffModel::headerData(int section, Qt::Orientation o, int role) const {
  if (role != Qt::DisplayRole || o != Qt::Horizontal)
    return QAbstractTableModel::headerData(section, o, role);
  return section >= 0 && section < kLayerColumnCount ? QString::fromUtf8(kLayerColumns[section]) : QVariant();
}

// ---- TensorDiffModel -------------------------------------------------------------------------

TensorDiffModel::TensorDiffModel(TraceDocument* doc, QObject* parent)
    : QAbstractTableModel(parent), doc_(doc) {
  auto reset = [this] {
    beginResetModel();
    endResetModel();
  };
  connect(doc_, &TraceDocument::datasetReset, this, reset);
  connect(doc_, &TraceDocument::reportLoaded, this, reset);
}

namespace {
const char* kTensorColumns[] = {"tensor",  "layer",   "full",         "rows differing", "rel-L2",
                                "max |Δ|", "max ulp", "non-finite Δ", "first differing"};
constexpr int kTensorColumnCount = 9;
}  // namespace

int TensorDiffModel::rowCount(const QModelIndex& parent) const {
  const auto& r = doc_->data().report;
  return parent.isValid() || !r ? 0 : int(r->tensors.size());
}
int TensorDiffModel::columnCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : kTensorColumnCount;
}

QVariant TensorDiffModel::data(const QModelIndex& index, int role) const {
  const auto& r = doc_->data().report;
  if (!index.isValid() || !r || index.row() >= int(r->tensors.size())) return {};
  const TensorDiff& t = r->tensors[index.row()];
  if (role == Qt::BackgroundRole)
    return t.rows_differing > 0 ? QVariant(QColor(0xfd, 0xe0, 0xdd)) : QVariant();
  if (role == Qt::TextAlignmentRole && index.column() > 0) return right_aligned();
  if (role != Qt::DisplayRole) return {};
  switch (index.column()) {
    case 0:
      return q(t.name);
    case 1:
      return t.layer;
    case 2:
      return t.full ? QStringLiteral("yes") : QStringLiteral("no");
    case 3:
      return QStringLiteral("%1 / %2").arg(t.rows_differing).arg(t.rows);
    case 4:
      return t.full ? QVariant(num(t.rel_l2)) : QVariant();
    case 5:
      return t.full ? QVariant(num(t.max_abs)) : QVariant();
    case 6:
      return t.full ? QVariant(qlonglong(t.max_ulp)) : QVariant();
    case 7:
      return qlonglong(t.nonfinite_differing);
    case 8:
      return t.first_digest_row < 0
                 ? QVariant()
                 : QVariant(QStringLiteral("seq %1 row %2").arg(t.first_digest_seq).arg(t.first_digest_row));
    default:
      return {};
  }
}

QVariant TensorDiffModel::headerData(int section, Qt::Orientation o, int role) const {
  if (role != Qt::DisplayRole || o != Qt::Horizontal)
    return QAbstractTableModel::headerData(section, o, role);
  return section >= 0 && section < kTensorColumnCount ? QString::fromUtf8(kTensorColumns[section])
                                                      : QVariant();
}

// ---- EnvModel --------------------------------------------------------------------------------

EnvModel::EnvModel(TraceDocument* doc, QObject* parent) : QAbstractTableModel(parent), doc_(doc) {
  connect(doc_, &TraceDocument::datasetReset, this, [this] {
    beginResetModel();
    rebuild();
    endResetModel();
  });
}

void EnvModel::rebuild() {
  rows_.clear();
  const Dataset& d = doc_->data();
  if (!d.summary) return;
  const TraceInfo& a = d.summary->a;
  const TraceInfo* b = d.summary->b ? &*d.summary->b : nullptr;
  auto add = [&](const QString& key, const std::string& va, const std::string& vb) {
    Row r{key, q(va), b ? q(vb) : QString(), b && va != vb};
    rows_.push_back(std::move(r));
  };
  std::set<std::string> keys;
  for (const auto& [k, v] : a.env) keys.insert(k);
  if (b)
    for (const auto& [k, v] : b->env) keys.insert(k);
  auto get = [](const EnvFingerprint& e, const std::string& k) {
    const auto it = e.find(k);
    return it == e.end() ? std::string("(absent)") : it->second;
  };
  for (const auto& k : keys) add(q(k), get(a.env, k), b ? get(b->env, k) : std::string());
  add(QStringLiteral("producer"), a.producer, b ? b->producer : "");
  add(QStringLiteral("created"), a.created, b ? b->created : "");
  add(QStringLiteral("format_version"), std::to_string(a.format_version),
      b ? std::to_string(b->format_version) : "");
  add(QStringLiteral("model_digest"), a.model_digest, b ? b->model_digest : "");
  add(QStringLiteral("weights_path"), a.weights_path, b ? b->weights_path : "");
  const TraceStepInfo* sa = step_info(a);
  const TraceStepInfo* sb = b ? step_info(*b) : nullptr;
  auto step_field = [&](const QString& key, auto get_field) {
    add(key, sa ? get_field(*sa) : std::string(), sb ? get_field(*sb) : std::string());
  };
  step_field(QStringLiteral("step"), [](const TraceStepInfo& s) { return std::to_string(s.index); });
  step_field(QStringLiteral("step kind"), [](const TraceStepInfo& s) { return s.kind; });
  step_field(QStringLiteral("step profile"), [](const TraceStepInfo& s) { return s.profile; });
  step_field(QStringLiteral("step seed"), [](const TraceStepInfo& s) { return std::to_string(s.seed); });
  step_field(QStringLiteral("step threads"),
             [](const TraceStepInfo& s) { return std::to_string(s.threads); });
  step_field(QStringLiteral("step capture"), [](const TraceStepInfo& s) { return s.capture; });
}

int EnvModel::rowCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : int(rows_.size());
}
int EnvModel::columnCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : (doc_->data().comparison() ? 3 : 2);
}

QVariant EnvModel::data(const QModelIndex& index, int role) const {
  if (!index.isValid() || index.row() >= int(rows_.size()) || index.column() >= columnCount()) return {};
  const Row& r = rows_[index.row()];
  switch (role) {
    case Qt::DisplayRole:
    case Qt::ToolTipRole:
      return index.column() == 0 ? r.key : index.column() == 1 ? r.a : r.b;
    case Qt::BackgroundRole:
      return r.differs ? QVariant(QColor(0xfd, 0xe0, 0xdd)) : QVariant();
    case DiffersRole:
      return r.differs;
    default:
      return {};
  }
}

QVariant EnvModel::headerData(int section, Qt::Orientation o, int role) const {
  if (role != Qt::DisplayRole || o != Qt::Horizontal)
    return QAbstractTableModel::headerData(section, o, role);
  switch (section) {
    case 0:
      return QStringLiteral("key");
    case 1:
      return doc_->data().comparison() ? QStringLiteral("A (reference)") : QStringLiteral("value");
    case 2:
      return QStringLiteral("B (candidate)");
    default:
      return {};
  }
}

int EnvModel::differingRows() const {
  int n = 0;
  for (const auto& r : rows_) n += r.differs;
  return n;
}

// ---- KernelModel -----------------------------------------------------------------------------

namespace {

QString launch_text(const KernelRecord& k) {
  return QStringLiteral("grid (%1,%2,%3) block (%4,%5,%6) smem %7")
      .arg(k.grid[0])
      .arg(k.grid[1])
      .arg(k.grid[2])
      .arg(k.block[0])
      .arg(k.block[1])
      .arg(k.block[2])
      .arg(k.shared_bytes);
}
QString micros(const KernelRecord& k) {
  return QString::number(double(k.end_ns - k.start_ns) * 1e-3, 'f', 1);
}

}  // namespace

KernelModel::KernelModel(TraceDocument* doc, QObject* parent) : QAbstractTableModel(parent), doc_(doc) {
  connect(doc_, &TraceDocument::datasetReset, this, [this] {
    beginResetModel();
    rebuild();
    endResetModel();
  });
}

void KernelModel::rebuild() {
  rows_.clear();
  first_difference_ = -1;
  launches_ = 0;
  const Dataset& d = doc_->data();
  if (!d.summary) return;
  const KernelRecords& a = d.summary->a.kernels;
  const KernelRecords* b = d.summary->b ? &d.summary->b->kernels : nullptr;
  const int cols = columnCount();
  auto message = [&](const QString& text) {
    Row r;
    r.cells = QStringList{QString(), text};
    while (r.cells.size() < cols) r.cells << QString();
    rows_.push_back(std::move(r));
  };
  if (!b) {
    if (!a.available) return message(QStringLiteral("no kernel records: %1").arg(q(a.reason)));
    launches_ = int(a.kernels.size());
    for (size_t i = 0; i < a.kernels.size(); ++i) {
      const KernelRecord& k = a.kernels[i];
      rows_.push_back({QStringList{QString::number(i), q(k.name), launch_text(k),
                                   QString::number(k.registers), micros(k)},
                       false});
    }
    return;
  }
  if (!a.available || !b->available)
    return message(QStringLiteral("not compared: A %1, B %2")
                       .arg(a.available ? QStringLiteral("has records") : q(a.reason))
                       .arg(b->available ? QStringLiteral("has records") : q(b->reason)));
  const size_t n = std::max(a.kernels.size(), b->kernels.size());
  launches_ = int(n);
  for (size_t i = 0; i < n; ++i) {
    const KernelRecord* ka = i < a.kernels.size() ? &a.kernels[i] : nullptr;
    const KernelRecord* kb = i < b->kernels.size() ? &b->kernels[i] : nullptr;
    Row r;
    r.differs = !ka || !kb || !same_launch(*ka, *kb);
    if (r.differs && first_difference_ < 0) first_difference_ = int(i);
    r.cells = QStringList{QString::number(i),
                          ka ? q(ka->name) : QStringLiteral("(none)"),
                          ka ? launch_text(*ka) : QString(),
                          ka ? micros(*ka) : QString(),
                          kb ? q(kb->name) : QStringLiteral("(none)"),
                          kb ? launch_text(*kb) : QString(),
                          kb ? micros(*kb) : QString()};
    rows_.push_back(std::move(r));
  }
}

int KernelModel::rowCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : int(rows_.size());
}
int KernelModel::columnCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : (doc_->data().comparison() ? 7 : 5);
}

QVariant KernelModel::data(const QModelIndex& index, int role) const {
  if (!index.isValid() || index.row() >= int(rows_.size()) || index.column() >= columnCount()) return {};
  const Row& r = rows_[size_t(index.row())];
  switch (role) {
    case Qt::DisplayRole:
    case Qt::ToolTipRole:
      return index.column() < r.cells.size() ? r.cells[index.column()] : QString();
    case Qt::BackgroundRole:
      if (!r.differs) return {};
      return index.row() == first_difference_ ? QVariant(QColor(0xf4, 0xa5, 0x9c))
                                              : QVariant(QColor(0xfd, 0xe0, 0xdd));
    case DiffersRole:
      return r.differs;
    default:
      return {};
  }
}

QVariant KernelModel::headerData(int section, Qt::Orientation o, int role) const {
  if (role != Qt::DisplayRole || o != Qt::Horizontal)
    return QAbstractTableModel::headerData(section, o, role);
  static const QStringList single{QStringLiteral("#"), QStringLiteral("kernel"), QStringLiteral("launch"),
                                  QStringLiteral("registers"), QStringLiteral("µs")};
  static const QStringList pair{QStringLiteral("#"),        QStringLiteral("A kernel"),
                                QStringLiteral("A launch"), QStringLiteral("A µs"),
                                QStringLiteral("B kernel"), QStringLiteral("B launch"),
                                QStringLiteral("B µs")};
  const QStringList& h = doc_->data().comparison() ? pair : single;
  return section < h.size() ? QVariant(h[section]) : QVariant();
}

// ---- IndexerSetModel -------------------------------------------------------------------------

IndexerSetModel::IndexerSetModel(QObject* parent) : QAbstractTableModel(parent) {}

void IndexerSetModel::setDetail(DetailPtr d) {
  beginResetModel();
  detail_ = std::move(d);
  rows_.clear();
  if (detail_ && detail_->has_indexer) {
    for (int32_t g : detail_->indexer_common) rows_.emplace_back(g, SetSide::Common);
    for (int32_t g : detail_->indexer_only_a) rows_.emplace_back(g, SetSide::OnlyA);
    for (int32_t g : detail_->indexer_only_b) rows_.emplace_back(g, SetSide::OnlyB);
    std::sort(rows_.begin(), rows_.end());
  }
  endResetModel();
}

int IndexerSetModel::rowCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : int(rows_.size());
}
int IndexerSetModel::columnCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : (detail_ && !detail_->comparison ? 2 : 4);
}

QVariant IndexerSetModel::data(const QModelIndex& index, int role) const {
  if (!index.isValid() || index.row() >= int(rows_.size())) return {};
  const auto& [g, side] = rows_[index.row()];
  const bool cmp = detail_ && detail_->comparison;
  if (index.column() >= columnCount()) return {};
  const int column = cmp ? index.column() : (index.column() == 0 ? 0 : 3);  // single: group, set
  switch (role) {
    case Qt::DisplayRole:
      switch (column) {
        case 0:
          return g;
        case 1:
          return side != SetSide::OnlyB ? QStringLiteral("✓") : QString();
        case 2:
          return cmp && side != SetSide::OnlyA ? QStringLiteral("✓") : QString();
        case 3:
          return set_label(side, cmp);
      }
      return {};
    case Qt::ForegroundRole:
      return column == 3 ? QVariant(set_color(side)) : QVariant();
    case SideRole:
      return int(side);
    default:
      return {};
  }
}

QVariant IndexerSetModel::headerData(int section, Qt::Orientation o, int role) const {
  if (role != Qt::DisplayRole || o != Qt::Horizontal)
    return QAbstractTableModel::headerData(section, o, role);
  static const char* names[] = {"group", "A", "B", "set"};
  if (section < 0 || section >= columnCount()) return {};
  const bool cmp = !detail_ || detail_->comparison;
  return QString::fromUtf8(names[cmp ? section : (section == 0 ? 0 : 3)]);
}

// ---- ExpertModel -----------------------------------------------------------------------------

ExpertModel::ExpertModel(QObject* parent) : QAbstractTableModel(parent) {}

void ExpertModel::setDetail(DetailPtr d) {
  beginResetModel();
  detail_ = std::move(d);
  endResetModel();
}

int ExpertModel::rowCount(const QModelIndex& parent) const {
  return parent.isValid() || !detail_ ? 0 : int(detail_->experts.size());
}
int ExpertModel::columnCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : (detail_ && !detail_->comparison ? 2 : 4);
}

QVariant ExpertModel::data(const QModelIndex& index, int role) const {
  if (!index.isValid() || !detail_ || index.row() >= int(detail_->experts.size())) return {};
  const ExpertChoice& e = detail_->experts[index.row()];
  const SetSide side = e.in_a && (e.in_b || !detail_->comparison) ? SetSide::Common
                       : e.in_a                                   ? SetSide::OnlyA
                                                                  : SetSide::OnlyB;
  if (index.column() >= columnCount()) return {};
  const int column = index.column();  // single mode: expert, weight
  switch (role) {
    case Qt::DisplayRole:
      switch (column) {
        case 0:
          return e.id;
        case 1:
          return e.in_a ? QVariant(double(e.weight_a)) : QVariant();
        case 2:
          return e.in_b ? QVariant(double(e.weight_b)) : QVariant();
        case 3:
          return set_label(side, detail_->comparison);
      }
      return {};
    case Qt::ForegroundRole:
      return column == 3 ? QVariant(set_color(side)) : QVariant();
    case SideRole:
      return int(side);
    default:
      return {};
  }
}

QVariant ExpertModel::headerData(int section, Qt::Orientation o, int role) const {
  if (role != Qt::DisplayRole || o != Qt::Horizontal)
    return QAbstractTableModel::headerData(section, o, role);
  static const char* names[] = {"expert", "weight A", "weight B", "set"};
  if (section < 0 || section >= columnCount()) return {};
  if (detail_ && !detail_->comparison && section == 1) return QStringLiteral("weight");
  return QString::fromUtf8(names[section]);
}

// ---- WorstElementsModel ----------------------------------------------------------------------

WorstElementsModel::WorstElementsModel(QObject* parent) : QAbstractTableModel(parent) {}

void WorstElementsModel::setDetail(DetailPtr d, int tensor) {
  beginResetModel();
  detail_ = std::move(d);
  tensor_ = tensor;
  endResetModel();
}

const TensorDetail* WorstElementsModel::tensor() const {
  return detail_ && tensor_ >= 0 && tensor_ < int(detail_->tensors.size()) ? &detail_->tensors[tensor_]
                                                                           : nullptr;
}

int WorstElementsModel::rowCount(const QModelIndex& parent) const {
  const TensorDetail* t = tensor();
  return parent.isValid() || !t ? 0 : int(t->worst.size());
}
int WorstElementsModel::columnCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : 4;
}

QVariant WorstElementsModel::data(const QModelIndex& index, int role) const {
  const TensorDetail* t = tensor();
  if (!index.isValid() || !t || index.row() >= int(t->worst.size())) return {};
  if (role == Qt::TextAlignmentRole) return right_aligned();
  if (role != Qt::DisplayRole) return {};
  const WorstElement& w = t->worst[index.row()];
  switch (index.column()) {
    case 0:
      return qlonglong(w.index);
    case 1:
      return num(w.a, 8);
    case 2:
      return num(w.b, 8);
    case 3:
      return num(w.abs_diff, 4);
    default:
      return {};
  }
}

QVariant WorstElementsModel::headerData(int section, Qt::Orientation o, int role) const {
  if (role != Qt::DisplayRole || o != Qt::Horizontal)
    return QAbstractTableModel::headerData(section, o, role);
  static const char* names[] = {"element", "A", "B", "|B − A|"};
  return section >= 0 && section < 4 ? QString::fromUtf8(names[section]) : QVariant();
}

}  // namespace dsv4::gui
