#include "server/quant_dynamic.h"

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/config_keys.h"

namespace tgis::server {

namespace {

using config_keys::BoolKey;
using config_keys::IntKey;
using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

absl::StatusOr<DynamicRule> ReadRule(const std::string& key, const OrderedJson& overrides,
                                     const std::string& where, const DynamicRuleKeys& keys) {
  const std::string at = absl::StrCat(where, ": dynamic rule '", key, "'");
  DynamicRule rule;
  rule.key = key;
  rule.excluded = key.rfind("-:", 0) == 0;
  const std::string pattern =
      rule.excluded || key.rfind("+:", 0) == 0 ? key.substr(2) : std::string(key);
  try {
    rule.pattern = std::make_shared<const std::regex>(pattern, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        at, ": not a regular expression this server reads (ECMAScript syntax): ", e.what()));
  }
  if (!overrides.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(at, " = ", overrides.dump(), ": expected an object"));
  }
  if (rule.excluded) {
    if (!overrides.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, " = ", overrides.dump(),
                       ": a \"-:\" rule leaves its modules unquantized, so it "
                       "overrides nothing (expected {})"));
    }
    return rule;
  }
  const Json j = Json::parse(overrides.dump());  // the typed readers take sorted JSON
  for (const auto& [name, value] : j.items()) {
    if (name == "bits") {
      auto bits = IntKey(j, at, "bits", std::nullopt);
      if (!bits.ok()) return bits.status();
      if (keys.bits.count(static_cast<int>(*bits)) == 0) {
        return absl::UnimplementedError(absl::StrCat(
            at, ": bits = ", *bits, ": ", absl::StrJoin(keys.bits, " or "), " bits are supported"));
      }
      rule.bits = static_cast<int>(*bits);
    } else if (name == "group_size") {
      auto group = config_keys::GroupSizeKey(j, at);
      if (!group.ok()) return group.status();
      rule.group_size = *group;
    } else if (keys.tensor_led.count(name) != 0) {
      if (auto b = BoolKey(j, at, name.c_str(), false); !b.ok()) return b.status();
    } else if (keys.ignored.count(name) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, ": key '", name, "' is not understood by this server"));
    }
  }
  return rule;
}

}  // namespace

absl::StatusOr<OrderedJson> ReadInFileOrder(const std::filesystem::path& file,
                                            const std::string& object_key, const std::string& key) {
  std::ifstream in(file, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  const OrderedJson root = OrderedJson::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(file.string(), ": not a JSON object"));
  }
  const OrderedJson* config = &root;
  if (!object_key.empty()) {
    auto it = root.find(object_key);
    if (it == root.end() || !it->is_object()) return OrderedJson();
    config = &*it;
  }
  auto it = config->find(key);
  return it == config->end() ? OrderedJson() : *it;
}

absl::StatusOr<std::vector<DynamicRule>> ReadDynamicRules(const std::filesystem::path& file,
                                                          const std::string& object_key,
                                                          const std::string& where,
                                                          const DynamicRuleKeys& keys) {
  auto dynamic = ReadInFileOrder(file, object_key, "dynamic");
  if (!dynamic.ok()) return dynamic.status();
  if (dynamic->is_null()) return std::vector<DynamicRule>{};
  if (!dynamic->is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": dynamic = ", dynamic->dump(), ": expected an object"));
  }
  std::vector<DynamicRule> rules;
  for (const auto& [key, overrides] : dynamic->items()) {
    auto rule = ReadRule(key, overrides, where, keys);
    if (!rule.ok()) return rule.status();
    rules.push_back(*std::move(rule));
  }
  return rules;
}

const DynamicRule* MatchDynamicRule(const std::vector<DynamicRule>& rules,
                                    const std::string& name) {
  for (const DynamicRule& rule : rules) {
    if (std::regex_search(name, *rule.pattern,
                          rule.search ? std::regex_constants::match_default
                                      : std::regex_constants::match_continuous)) {
      return &rule;
    }
  }
  return nullptr;
}

}  // namespace tgis::server
