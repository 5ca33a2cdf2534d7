// dsv4 profile list | show | diff: the numerics profiles (docs/PROFILES.md).
#include <fmt/core.h>
#include <fmt/format.h>

#include <memory>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "model/profile.h"

namespace dsv4::cli {

namespace {

struct ProfileArgs {
  std::string a, b;
  bool json = false;
  bool canonical = false;
};

nlohmann::ordered_json profile_json(const NumericsProfile& p) {
  nlohmann::ordered_json j;
  j["name"] = p.name;
  j["description"] = p.description;
  j["digest"] = profile_digest(p);
  j["builtin"] = is_builtin_profile(p.name) && profile_digest(profile_by_name(p.name)) == profile_digest(p);
  nlohmann::ordered_json sites;
  for (const auto& s : profile_sites()) sites[s.key] = s.get(p);
  j["sites"] = std::move(sites);
  return j;
}

int run_list(const ProfileArgs& a) {
  if (a.json) {
    nlohmann::ordered_json j = nlohmann::ordered_json::array();
    for (const auto& n : profile_names()) j.push_back(profile_json(profile_by_name(n)));
    fmt::print("{}\n", j.dump(2));
    return 0;
  }
  fmt::print("{:<24} {:<16}  {}\n", "profile", "digest", "description");
  for (const auto& n : profile_names()) {
    const NumericsProfile p = profile_by_name(n);
    fmt::print("{:<24} {:<16}  {}\n", p.name, profile_digest(p), p.description);
  }
  fmt::print("\nsites ({}):\n", profile_sites().size());
  for (const auto& s : profile_sites())
    fmt::print("  {:<20} {}\n  {:<20}   values: {}\n", s.key, s.choice, "", s.values);
  return 0;
}

int run_show(const ProfileArgs& a) {
  const NumericsProfile p = load_profile(a.a);
  if (a.json) {
    fmt::print("{}\n", profile_json(p).dump(2));
    return 0;
  }
  // A built-in as shipped (with its comments), unless the canonical text is asked for.
  if (is_builtin_profile(a.a) && !a.canonical)
    fmt::print("{}", builtin_profile_source(a.a));
  else
    fmt::print("{}", profile_text(p));
  return 0;
}

int run_diff(const ProfileArgs& a) {
  const NumericsProfile pa = load_profile(a.a), pb = load_profile(a.b);
  const auto d = profile_diff(pa, pb);
  if (a.json) {
    nlohmann::ordered_json j;
    j["a"] = {{"name", pa.name}, {"digest", profile_digest(pa)}};
    j["b"] = {{"name", pb.name}, {"digest", profile_digest(pb)}};
    nlohmann::ordered_json sites = nlohmann::ordered_json::array();
    for (const auto& s : d) sites.push_back({{"site", s.key}, {"a", s.a}, {"b", s.b}});
    j["sites"] = std::move(sites);
    fmt::print("{}\n", j.dump(2));
    return 0;
  }
  if (d.empty()) {
    fmt::print("{} and {}: the same precision map ({} sites)\n", pa.name, pb.name, profile_sites().size());
    return 0;
  }
  fmt::print("{} and {} differ at {} of {} sites:\n", pa.name, pb.name, d.size(), profile_sites().size());
  fmt::print("  {:<20} {:<24} {}\n", "site", pa.name, pb.name);
  for (const auto& s : d) fmt::print("  {:<20} {:<24} {}\n", s.key, s.a, s.b);
  return 0;
}

}  // namespace

void register_profile_commands(CLI::App& app) {
  CLI::App* prof = app.add_subcommand("profile", "Numerics profiles: the precision maps (docs/PROFILES.md)");
  prof->require_subcommand(1);
  auto args = std::make_shared<ProfileArgs>();

  CLI::App* list = prof->add_subcommand("list", "The built-in profiles and the sites a profile sets");
  list->add_flag("--json", args->json, "JSON output");
  list->callback([args] { set_action([args] { return run_list(*args); }); });

  CLI::App* show = prof->add_subcommand("show", "Print a profile (a built-in's name or a profile file)");
  show->add_option("profile", args->a, "A built-in's name or a profile file")->required();
  show->add_flag("--json", args->json, "JSON output");
  show->add_flag("--canonical", args->canonical,
                 "Print the canonical text (what traces store) instead of a built-in's commented file");
  show->callback([args] { set_action([args] { return run_show(*args); }); });

  CLI::App* diff = prof->add_subcommand("diff", "The sites where two profiles differ");
  diff->add_option("a", args->a, "Profile A (name or file)")->required();
  diff->add_option("b", args->b, "Profile B (name or file)")->required();
  diff->add_flag("--json", args->json, "JSON output");
  diff->callback([args] { set_action([args] { return run_diff(*args); }); });
}

}  // namespace dsv4::cli
