#include "gui/models/table_models.h"

#include <QLocale>
#include <cmath>
#include <set>

#include "kernels/numerics/numerics.h"

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

// A cell of the set tables (indexer groups, experts): `value(column)` before the set column (3), the
// set's label and colour in it, the side under SetTableModel::SideRole.
template <typename Value>
QVariant set_cell(int column, int role, SetSide side, bool comparison, Value value) {
  switch (role) {
    case Qt::DisplayRole:
      return column == 3 ? QVariant(set_label(side, comparison)) : value(column);
    case Qt::ForegroundRole:
      return column == 3 ? QVariant(set_color(side)) : QVariant();
    case SetTableModel::SideRole:
      return int(side);
    default:
      return {};
  }
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

// ---- ColumnTableModel ------------------------------------------------------------------------

int ColumnTableModel::rowCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : rows();
}

int ColumnTableModel::columnCount(const QModelIndex& parent) const {
  return parent.isValid() ? 0 : int(columns().size());
}

QVariant ColumnTableModel::headerData(int section, Qt::Orientation o, int role) const {
  if (role != Qt::DisplayRole || o != Qt::Horizontal)
    return QAbstractTableModel::headerData(section, o, role);
  const QStringList names = columns();
  return section >= 0 && section < names.size() ? QVariant(names[section]) : QVariant();
}

// ---- TokenModel ------------------------------------------------------------------------------

TokenModel::TokenModel(TraceDocument* doc, QObject* parent) : ColumnTableModel(parent), doc_(doc) {
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

int TokenModel::rows() const {
  const SeqTokens* s = tokens();
  return s ? int(s->logprobs_a.size()) : 0;
}

QStringList TokenModel::columns() const {
  if (!comparison())
    return {QStringLiteral("position"), QStringLiteral("next token"), QStringLiteral("log p")};
  return {QStringLiteral("position"), QStringLiteral("next token"), QStringLiteral("log p A"),
          QStringLiteral("log p B"),  QStringLiteral("|Δ|"),        QStringLiteral("p_B / p_A")};
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
      return num::exp_f64(b - a);  // the diff report's ratio
    default:
      return {};
  }
}

// ---- SummaryModel ----------------------------------------------------------------------------

SummaryModel::SummaryModel(TraceDocument* doc, QObject* parent) : ColumnTableModel(parent), doc_(doc) {
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
  const QString layout_a = q(recorded_layout(s.a.env));
  if (!s.b || recorded_layout(s.b->env) == recorded_layout(s.a.env)) {
    add(QStringLiteral("layout"), layout_a);
  } else {
    add(QStringLiteral("layout A"), layout_a);
    add(QStringLiteral("layout B"), q(recorded_layout(s.b->env)));
  }
  if (!s.b) {
    add(QStringLiteral("producer"), q(s.a.producer));
    add(QStringLiteral("created"), q(s.a.created));
    add(QStringLiteral("seal"), q(s.a.seal));
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
  } else if (r.tensors.empty()) {
    add(QStringLiteral("first divergence"),
        QStringLiteral("not compared: an external step holds no digests"));
  } else {
    add(QStringLiteral("first divergence"), QStringLiteral("none: every digest is equal"));
  }
  if (!r.profile_sites_known)
    add(QStringLiteral("profile sites"), QStringLiteral("unknown (a step's profile is not one this build knows)"));
  else if (r.profile_sites.empty())
    add(QStringLiteral("profile sites"), QStringLiteral("the same precision map"));
  for (const ProfileSiteDiff& x : r.profile_sites)
    add(QStringLiteral("profile %1").arg(q(x.key)), QStringLiteral("%1 vs %2").arg(q(x.a), q(x.b)));
  for (const std::string& n : r.notes) add(QStringLiteral("note"), q(n));
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
  if (!r.training_note.empty()) add(QStringLiteral("training"), q(r.training_note));
  if (!r.training) return;
  const TrainingDiff& t = *r.training;
  add(QStringLiteral("gradients differing"), QStringLiteral("%1 of %2 parameters (%3 held in full)")
                                                 .arg(t.params_differing)
                                                 .arg(t.params_trained)
                                                 .arg(t.params_full));
  for (const SettingDiff& x : t.settings)
    add(QStringLiteral("setting %1").arg(q(x.key)), QStringLiteral("%1 vs %2").arg(q(x.a), q(x.b)));
  for (const MetricDiff& m : t.metrics)
    add(QStringLiteral("training %1").arg(q(m.name)), QStringLiteral("%1 vs %2").arg(num(m.a), num(m.b)));
}

int SummaryModel::rows() const {
  return int(lines_.size());
}
QStringList SummaryModel::columns() const {
  return {QStringLiteral("quantity"), QStringLiteral("value")};
}

QVariant SummaryModel::data(const QModelIndex& index, int role) const {
  if (!index.isValid() || index.row() >= int(lines_.size())) return {};
  if (role != Qt::DisplayRole && role != Qt::ToolTipRole) return {};
  const auto& l = lines_[index.row()];
  return index.column() == 0 ? l.first : l.second;
}

QString SummaryModel::value(const QString& key) const {
  for (const auto& l : lines_)
    if (l.first == key) return l.second;
  return {};
}

// ---- LayerDiffModel --------------------------------------------------------------------------

ReportTableModel::ReportTableModel(TraceDocument* doc, QObject* parent)
    : ColumnTableModel(parent), doc_(doc) {
  auto reset = [this] {
    beginResetModel();
    endResetModel();
  };
  connect(doc_, &TraceDocument::datasetReset, this, reset);
  connect(doc_, &TraceDocument::reportLoaded, this, reset);
}

const DiffReport* ReportTableModel::report() const {
  const auto& r = doc_->data().report;
  return r ? &*r : nullptr;
}

int LayerDiffModel::rows() const {
  return report() ? int(report()->layers.size()) : 0;
}
QStringList LayerDiffModel::columns() const {
  return {QStringLiteral("layer"),
          QStringLiteral("ratio"),
          QStringLiteral("overlap mean"),
          QStringLiteral("overlap min"),
          QStringLiteral("indexer flips tie/conf"),
          QStringLiteral("routing exact"),
          QStringLiteral("routing Jaccard"),
          QStringLiteral("routing flips tie/conf"),
          QStringLiteral("mHC comb max"),
          QStringLiteral("same-selection share"),
          QStringLiteral("rows out differing")};
}

QVariant LayerDiffModel::data(const QModelIndex& index, int role) const {
  const DiffReport* r = report();
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

// ---- TensorDiffModel -------------------------------------------------------------------------

int TensorDiffModel::rows() const {
  return report() ? int(report()->tensors.size()) : 0;
}
QStringList TensorDiffModel::columns() const {
  return {
      QStringLiteral("tensor"),         QStringLiteral("layer"),        QStringLiteral("full"),
      QStringLiteral("rows differing"), QStringLiteral("rel-L2"),       QStringLiteral("max |Δ|"),
      QStringLiteral("max ulp"),        QStringLiteral("non-finite Δ"), QStringLiteral("first differing")};
}

QVariant TensorDiffModel::data(const QModelIndex& index, int role) const {
  const DiffReport* r = report();
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

// ---- DatasetTableModel -----------------------------------------------------------------------

DatasetTableModel::DatasetTableModel(TraceDocument* doc, QObject* parent)
    : ColumnTableModel(parent), doc_(doc) {
  connect(doc_, &TraceDocument::datasetReset, this, [this] {
    beginResetModel();
    rebuild();
    endResetModel();
  });
}

// ---- EnvModel --------------------------------------------------------------------------------

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
  add(QStringLiteral("seal"), a.seal, b ? b->seal : "");
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

int EnvModel::rows() const {
  return int(rows_.size());
}
QStringList EnvModel::columns() const {
  if (!doc_->data().comparison()) return {QStringLiteral("key"), QStringLiteral("value")};
  return {QStringLiteral("key"), QStringLiteral("A (reference)"), QStringLiteral("B (candidate)")};
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

int KernelModel::rows() const {
  return int(rows_.size());
}
QStringList KernelModel::columns() const {
  if (!doc_->data().comparison())
    return {QStringLiteral("#"), QStringLiteral("kernel"), QStringLiteral("launch"),
            QStringLiteral("registers"), QStringLiteral("µs")};
  return {QStringLiteral("#"),    QStringLiteral("A kernel"), QStringLiteral("A launch"),
          QStringLiteral("A µs"), QStringLiteral("B kernel"), QStringLiteral("B launch"),
          QStringLiteral("B µs")};
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

// ---- IndexerSetModel -------------------------------------------------------------------------

SetTableModel::SetTableModel(QObject* parent) : ColumnTableModel(parent) {}

void SetTableModel::setDetail(DetailPtr d) {
  beginResetModel();
  detail_ = std::move(d);
  detail_changed();
  endResetModel();
}

void IndexerSetModel::detail_changed() {
  rows_.clear();
  if (detail_ && detail_->has_indexer) {
    for (int32_t g : detail_->indexer_common) rows_.emplace_back(g, SetSide::Common);
    for (int32_t g : detail_->indexer_only_a) rows_.emplace_back(g, SetSide::OnlyA);
    for (int32_t g : detail_->indexer_only_b) rows_.emplace_back(g, SetSide::OnlyB);
    std::sort(rows_.begin(), rows_.end());
  }
}

int IndexerSetModel::rows() const {
  return int(rows_.size());
}
QStringList IndexerSetModel::columns() const {
  if (detail_ && !detail_->comparison) return {QStringLiteral("group"), QStringLiteral("set")};
  return {QStringLiteral("group"), QStringLiteral("A"), QStringLiteral("B"), QStringLiteral("set")};
}

QVariant IndexerSetModel::data(const QModelIndex& index, int role) const {
  if (!index.isValid() || index.row() >= int(rows_.size())) return {};
  const auto& [g, side] = rows_[index.row()];
  const bool cmp = detail_ && detail_->comparison;
  if (index.column() >= columnCount()) return {};
  const int column = cmp ? index.column() : (index.column() == 0 ? 0 : 3);  // single: group, set
  return set_cell(column, role, side, cmp, [&](int c) -> QVariant {
    if (c == 0) return g;
    if (c == 1) return side != SetSide::OnlyB ? QStringLiteral("✓") : QString();
    return cmp && side != SetSide::OnlyA ? QStringLiteral("✓") : QString();
  });
}

// ---- ExpertModel -----------------------------------------------------------------------------

int ExpertModel::rows() const {
  return detail_ ? int(detail_->experts.size()) : 0;
}
QStringList ExpertModel::columns() const {
  if (detail_ && !detail_->comparison) return {QStringLiteral("expert"), QStringLiteral("weight")};
  return {QStringLiteral("expert"), QStringLiteral("weight A"), QStringLiteral("weight B"),
          QStringLiteral("set")};
}

QVariant ExpertModel::data(const QModelIndex& index, int role) const {
  if (!index.isValid() || !detail_ || index.row() >= int(detail_->experts.size())) return {};
  const ExpertChoice& e = detail_->experts[index.row()];
  const SetSide side = e.in_a && (e.in_b || !detail_->comparison) ? SetSide::Common
                       : e.in_a                                   ? SetSide::OnlyA
                                                                  : SetSide::OnlyB;
  if (index.column() >= columnCount()) return {};
  const int column = index.column();  // single mode: expert, weight
  return set_cell(column, role, side, detail_->comparison, [&](int c) -> QVariant {
    if (c == 0) return e.id;
    if (c == 1) return e.in_a ? QVariant(double(e.weight_a)) : QVariant();
    return e.in_b ? QVariant(double(e.weight_b)) : QVariant();
  });
}

// ---- WorstElementsModel ----------------------------------------------------------------------

WorstElementsModel::WorstElementsModel(QObject* parent) : ColumnTableModel(parent) {}

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

int WorstElementsModel::rows() const {
  const TensorDetail* t = tensor();
  return t ? int(t->worst.size()) : 0;
}
QStringList WorstElementsModel::columns() const {
  return {QStringLiteral("element"), QStringLiteral("A"), QStringLiteral("B"), QStringLiteral("|B − A|")};
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

}  // namespace dsv4::gui
