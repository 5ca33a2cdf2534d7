#include "replay/bisect.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>

#include "kernels/numerics/numerics.h"
#include "model/collect.h"
#include "model/decision_sets.h"
#include "model/error.h"
#include "model/forward.h"

namespace dsv4 {

namespace {

struct Run {
  ForwardResult result;
  DecisionLog log;
  NumericsProfile profile;
};

// Flips of one kind of decision between A's and X's records (those `counted` keeps), with the diff's
// relative tie rule (replay/diff.h): per layer, the threshold is f × the median |margin| of the layer's
// rows in every sequence of both runs.
template <typename Rec, typename Counted>
void count_flips(const std::map<DecisionLog::Key, Rec>& a, const std::map<DecisionLog::Key, Rec>& x, double factor,
                 Counted counted, int64_t& rows, int64_t& flips, int64_t& ties) {
  std::map<int, std::vector<std::pair<const Rec*, const Rec*>>> by_layer;
  for (const auto& [key, ra] : a) {
    const auto it = x.find(key);
    if (it != x.end() && counted(ra)) by_layer[key.second].emplace_back(&ra, &it->second);
  }
  for (const auto& [layer, pairs] : by_layer) {
    std::vector<float> ma, mx;
    for (const auto& [ra, rx] : pairs) {
      ma.insert(ma.end(), ra->margin.begin(), ra->margin.end());
      mx.insert(mx.end(), rx->margin.begin(), rx->margin.end());
    }
    const auto threshold = relative_tie_threshold({&ma, &mx}, factor);
    const double thr = threshold ? *threshold : std::nan("");
    for (const auto& [ra, rx] : pairs)
      for (int64_t t = 0; t < ra->T; ++t) {
        ++rows;
        if (valid_ids(ra->ids, ra->k, t) == valid_ids(rx->ids, rx->k, t)) continue;
        ++flips;
        if (is_tie_flip(ra->margin[size_t(t)], rx->margin[size_t(t)], thr)) ++ties;
      }
  }
}

BisectMetrics compare_runs(const Run& a, const Run& x) {
  BisectMetrics m;
  double sum_abs = 0, sum_k3 = 0;
  for (size_t s = 0; s < a.result.seqs.size(); ++s) {
    const auto& la = a.result.seqs[s].logprobs;
    const auto& lx = x.result.seqs[s].logprobs;
    for (size_t t = 0; t < la.size(); ++t) {
      const double log_r = double(lx[t]) - double(la[t]);
      sum_abs += std::fabs(log_r);
      sum_k3 += (num::exp_f64(log_r) - 1.0) - log_r;
      m.max_abs_dlogp = std::max(m.max_abs_dlogp, std::fabs(log_r));
      ++m.tokens;
    }
  }
  if (m.tokens > 0) {
    m.mean_abs_dlogp = sum_abs / double(m.tokens);
    m.kl_k3 = sum_k3 / double(m.tokens);
  }
  const double factor = tie_factor(a.profile, x.profile);
  count_flips(a.log.indexer, x.log.indexer, factor, [](const IndexerRecord&) { return true; }, m.indexer_rows,
              m.indexer_flips, m.indexer_tie_flips);
  count_flips(a.log.routing, x.log.routing, factor, [](const RoutingRecord& r) { return !r.hashed; },
              m.routing_rows, m.routing_flips, m.routing_tie_flips);
  return m;
}

std::string set_name(const std::vector<std::string>& sites) {
  return fmt::format("{{{}}}", fmt::join(sites, ", "));
}

}  // namespace

BisectReport bisect_profiles(const Weights& w, const std::vector<std::vector<int32_t>>& seqs,
                             const BisectOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  BisectReport rep;
  rep.profile_a = opt.a.name;
  rep.profile_b = opt.b.name;
  rep.digest_a = profile_digest(opt.a);
  rep.digest_b = profile_digest(opt.b);
  rep.sites = profile_diff(opt.a, opt.b);
  if (rep.sites.empty())
    throw InputError(
        fmt::format("bisect: profiles '{}' and '{}' have the same precision map: nothing to bisect",
                    opt.a.name, opt.b.name));
  rep.seqs = int64_t(seqs.size());
  std::vector<std::string> all;
  for (const auto& d : rep.sites) all.push_back(d.key);

  // The switched sets, in the order they run: A, all, each single site, then the halving's groups.
  std::vector<std::vector<std::string>> sets{{}, all};
  for (const auto& s : all)
    if (all.size() > 1) sets.push_back({s});
  std::vector<std::vector<std::string>> groups;
  std::function<void(const std::vector<std::string>&)> halve = [&](const std::vector<std::string>& s) {
    if (s.size() < 2) return;
    const size_t mid = s.size() / 2;
    const std::vector<std::string> lo(s.begin(), s.begin() + long(mid)), hi(s.begin() + long(mid), s.end());
    for (const auto* h : {&lo, &hi}) {
      if (h->size() >= 2) groups.push_back(*h);
      halve(*h);
    }
  };
  halve(all);
  for (const auto& g : groups) sets.push_back(g);
  const int runs = int(sets.size());

  Run base;
  std::map<std::vector<std::string>, BisectMetrics> done;
  for (int i = 0; i < runs; ++i) {
    const auto& set = sets[size_t(i)];
    Run r;
    r.profile = opt.a;
    for (const auto& key : set) copy_profile_site(r.profile, opt.b, key);
    if (!set.empty()) r.profile.name = fmt::format("{} + {}", opt.a.name, set_name(set));
    if (opt.progress) opt.progress(set.empty() ? opt.a.name : r.profile.name, i + 1, runs);
    RunOptions ro;
    ro.profile = r.profile;
    ro.device = opt.device;
    ro.threads = opt.threads;
    ro.observer = &r.log;
    r.result = forward(w, seqs, ro);
    if (set.empty()) {
      base = std::move(r);
      continue;
    }
    done[set] = compare_runs(base, r);
  }
  rep.runs = runs;
  rep.all = {all, "all", done[all], 1.0};
  rep.tokens = rep.all.m.tokens;
  const double whole = rep.all.m.mean_abs_dlogp;
  auto explained = [&](const BisectMetrics& m) { return whole > 0 ? m.mean_abs_dlogp / whole : 0.0; };
  rep.all.explained = whole > 0 ? 1.0 : 0.0;
  for (const auto& s : all) {
    const BisectMetrics& m = all.size() > 1 ? done[{s}] : rep.all.m;
    rep.single.push_back({{s}, "site", m, explained(m)});
    rep.sum_single_explained += explained(m);
  }
  // Ranked: the log-prob share, then the flips, then site order (stable).
  std::stable_sort(rep.single.begin(), rep.single.end(), [](const BisectEntry& x, const BisectEntry& y) {
    if (x.explained != y.explained) return x.explained > y.explained;
    return x.m.indexer_flips + x.m.routing_flips > y.m.indexer_flips + y.m.routing_flips;
  });
  for (const auto& g : groups) rep.groups.push_back({g, "group", done[g], explained(done[g])});
  rep.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rep;
}

std::string bisect_to_json(const BisectReport& r) {
  using J = nlohmann::ordered_json;
  auto entry = [](const BisectEntry& e) {
    const BisectMetrics& m = e.m;
    return J{{"sites", e.sites},
             {"kind", e.kind},
             {"explained", e.explained},
             {"logprob",
              {{"tokens", m.tokens},
               {"mean_abs_diff", m.mean_abs_dlogp},
               {"max_abs_diff", m.max_abs_dlogp},
               {"kl_k3", m.kl_k3}}},
             {"indexer",
              {{"rows", m.indexer_rows}, {"flips", m.indexer_flips}, {"tie_flips", m.indexer_tie_flips}}},
             {"routing",
              {{"rows", m.routing_rows}, {"flips", m.routing_flips}, {"tie_flips", m.routing_tie_flips}}},
             {"confident_flips", m.confident_flips()}};
  };
  J j;
  j["format"] = "dsv4-bisect";
  j["version"] = 1;
  j["profile_a"] = {{"name", r.profile_a}, {"digest", r.digest_a}};
  j["profile_b"] = {{"name", r.profile_b}, {"digest", r.digest_b}};
  J sites = J::array();
  for (const auto& d : r.sites) sites.push_back({{"site", d.key}, {"a", d.a}, {"b", d.b}});
  j["sites"] = std::move(sites);
  j["seqs"] = r.seqs;
  j["tokens"] = r.tokens;
  j["all"] = entry(r.all);
  J single = J::array(), groups = J::array();
  for (const auto& e : r.single) single.push_back(entry(e));
  for (const auto& e : r.groups) groups.push_back(entry(e));
  j["ranking"] = std::move(single);
  j["groups"] = std::move(groups);
  j["sum_single_explained"] = r.sum_single_explained;
  j["runs"] = r.runs;
  j["seconds"] = r.seconds;
  return j.dump(2);
}

BisectReport bisect_from_json(const std::string& text, const std::string& source) {
  using J = nlohmann::json;
  BisectReport r;
  try {
    const J j = J::parse(text);
    if (!j.is_object() || j.value("format", "") != "dsv4-bisect")
      throw InputError(fmt::format("{}: not a dsv4 bisect report (no \"format\": \"dsv4-bisect\")", source));
    const int version = j.at("version").get<int>();
    if (version > 1)
      throw InputError(
          fmt::format("{}: bisect report version {} is newer than this build reads (1)", source, version));
    auto entry = [](const J& e) {
      BisectEntry b;
      b.sites = e.at("sites").get<std::vector<std::string>>();
      b.kind = e.at("kind").get<std::string>();
      b.explained = e.at("explained").get<double>();
      const J& l = e.at("logprob");
      b.m.tokens = l.at("tokens").get<int64_t>();
      b.m.mean_abs_dlogp = l.at("mean_abs_diff").get<double>();
      b.m.max_abs_dlogp = l.at("max_abs_diff").get<double>();
      b.m.kl_k3 = l.at("kl_k3").get<double>();
      const J& i = e.at("indexer");
      b.m.indexer_rows = i.at("rows").get<int64_t>();
      b.m.indexer_flips = i.at("flips").get<int64_t>();
      b.m.indexer_tie_flips = i.at("tie_flips").get<int64_t>();
      const J& ro = e.at("routing");
      b.m.routing_rows = ro.at("rows").get<int64_t>();
      b.m.routing_flips = ro.at("flips").get<int64_t>();
      b.m.routing_tie_flips = ro.at("tie_flips").get<int64_t>();
      return b;
    };
    r.profile_a = j.at("profile_a").at("name").get<std::string>();
    r.digest_a = j.at("profile_a").at("digest").get<std::string>();
    r.profile_b = j.at("profile_b").at("name").get<std::string>();
    r.digest_b = j.at("profile_b").at("digest").get<std::string>();
    for (const J& s : j.at("sites"))
      r.sites.push_back(
          {s.at("site").get<std::string>(), s.at("a").get<std::string>(), s.at("b").get<std::string>()});
    r.seqs = j.at("seqs").get<int64_t>();
    r.tokens = j.at("tokens").get<int64_t>();
    r.all = entry(j.at("all"));
    for (const J& e : j.at("ranking")) r.single.push_back(entry(e));
    for (const J& e : j.at("groups")) r.groups.push_back(entry(e));
    r.sum_single_explained = j.at("sum_single_explained").get<double>();
    r.runs = j.at("runs").get<int>();
    r.seconds = j.at("seconds").get<double>();
  } catch (const J::exception& e) {
    throw InputError(fmt::format("{}: not a readable bisect report: {}", source, e.what()));
  }
  return r;
}

std::string bisect_to_table(const BisectReport& r) {
  std::string o = fmt::format(
      "bisect {} -> {}: {} sites differ; {} sequence{}, {} log-probs; {} forwards in {:.1f} s\n\n",
      r.profile_a, r.profile_b, r.sites.size(), r.seqs, r.seqs == 1 ? "" : "s", r.tokens, r.runs, r.seconds);
  auto row = [](const std::string& what, const BisectEntry& e) {
    const BisectMetrics& m = e.m;
    return fmt::format("{:<52} {:>8.1f}% {:>11.3e} {:>11.3e} {:>10.3e} {:>9}/{:<5} {:>9}/{:<5}\n", what,
                       100.0 * e.explained, m.mean_abs_dlogp, m.max_abs_dlogp, m.kl_k3, m.indexer_flips,
                       m.indexer_tie_flips, m.routing_flips, m.routing_tie_flips);
  };
  o += fmt::format("{:<52} {:>9} {:>11} {:>11} {:>10} {:>15} {:>15}\n", "switched to B", "explained",
                   "|dlogp| mean", "|dlogp| max", "KL (k3)", "indexer flips", "routing flips");
  o += fmt::format("{:<52} {:>9} {:>11} {:>11} {:>10} {:>15} {:>15}\n", "", "", "", "", "", "(all/tie)",
                   "(all/tie)");
  for (const auto& e : r.single) {
    const auto& d =
        *std::find_if(r.sites.begin(), r.sites.end(), [&](const auto& s) { return s.key == e.sites[0]; });
    o += row(fmt::format("{} = {}", d.key, d.b), e);
  }
  if (!r.groups.empty()) {
    o += "halving:\n";
    for (const auto& e : r.groups) o += row("  " + set_name(e.sites), e);
  }
  o += row("all (= " + r.profile_b + ")", r.all);
  o += fmt::format(
      "\nthe singles explain {:.1f}% together{}\n", 100.0 * r.sum_single_explained,
      std::fabs(r.sum_single_explained - 1.0) > 0.25 ? " (far from 100%: the sites interact)" : "");
  return o;
}

}  // namespace dsv4
