// JSON schema -> regular expression (then the same automaton as a regex): the construction
// outlines made common (and vLLM's guided decoding used before xgrammar): properties in the
// schema's order, required ones present, optional ones optional, at most one space between
// tokens (an unbounded whitespace run lets a model loop on spaces). Keywords that constrain
// values beyond what this builds are refused by name; annotations are listed and skipped.
#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "grammar/grammar.h"

namespace tgis::grammar {
namespace {

using Json = nlohmann::ordered_json;

constexpr const char* kWs = "[ ]?";
constexpr const char* kStringChar = R"re(([^"\\\x00-\x1f]|\\(["\\/bfnrt]|u[0-9a-fA-F]{4})))re";
constexpr const char* kInteger = R"(-?(0|[1-9][0-9]*))";
constexpr const char* kNumber = R"(-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?)";

// Keywords that say something about the schema but constrain nothing generated.
const std::set<std::string> kAnnotations = {
    "title",      "description", "default",   "examples", "$schema",     "$id",          "$comment",
    "deprecated", "readOnly",    "writeOnly", "$defs",    "definitions", "discriminator"};
// Keywords read here.
const std::set<std::string> kServed = {"type",   "properties", "required",  "additionalProperties",
                                       "items",  "minItems",   "maxItems",  "enum",
                                       "const",  "anyOf",      "oneOf",     "allOf",
                                       "$ref",   "minLength",  "maxLength", "pattern",
                                       "format", "prefixItems"};

// Every character a regex could read as an operator, escaped.
std::string Escape(std::string_view text) {
  std::string out;
  for (char c : text) {
    if (std::string_view(R"(\.^$*+?()[]{}|-/#&~ )").find(c) != std::string_view::npos) {
      out.push_back('\\');
    }
    out.push_back(c);
  }
  return out;
}

// A const or enum value, with the spacing generated everywhere else (objects' keys in the
// value's order).
// Deeper values are refused before this recursion could exhaust the stack.
constexpr int kMaxLiteralDepth = 64;

std::string Literal(const Json& v, int depth = 0) {
  if (depth > kMaxLiteralDepth) return "";
  std::vector<std::string> items;
  if (v.is_object()) {
    for (const auto& [key, value] : v.items()) {
      items.push_back(
          absl::StrCat(kWs, Escape(Json(key).dump()), kWs, ":", kWs, Literal(value, depth + 1)));
    }
    return absl::StrCat(R"(\{)", absl::StrJoin(items, absl::StrCat(kWs, ",")), kWs, R"(\})");
  }
  if (v.is_array()) {
    for (const Json& item : v) items.push_back(Literal(item, depth + 1));
    return absl::StrCat(R"(\[)", kWs, absl::StrJoin(items, absl::StrCat(kWs, ",", kWs)), kWs,
                        R"(\])");
  }
  return Escape(v.dump());
}

// How deep a value nests (counted up to just past `limit`), without recursion.
int Depth(const Json& v, int limit = kMaxLiteralDepth) {
  int deepest = 0;
  std::vector<std::pair<const Json*, int>> stack = {{&v, 0}};
  while (!stack.empty()) {
    auto [at, depth] = stack.back();
    stack.pop_back();
    deepest = std::max(deepest, depth);
    if (depth > limit) break;
    if (at->is_structured()) {
      for (const Json& child : *at) stack.push_back({&child, depth + 1});
    }
  }
  return deepest;
}

class SchemaToRegex {
 public:
  SchemaToRegex(const Json& root, int depth) : root_(root), free_depth_(depth) {}

  absl::StatusOr<std::string> Value(const Json& s, const std::string& path) {
    if (s.is_boolean()) {
      if (!s.get<bool>()) return Bad(path, "false (no value is valid)");
      return AnyValue(free_depth_);
    }
    if (!s.is_object()) return Bad(path, "a schema must be an object or a boolean");
    if (++nesting_ > 64) return Bad(path, "nested too deeply");
    absl::StatusOr<std::string> out = Dispatch(s, path);
    --nesting_;
    return out;
  }

  std::string AnyValue(int depth) const {
    std::vector<std::string> alts = {String(0, -1), kNumber, "true", "false", "null"};
    if (depth > 0) {
      const std::string inner = AnyValue(depth - 1);
      alts.push_back(absl::StrCat(R"(\{)", kWs, "(", String(0, -1), kWs, ":", kWs, inner, "(", kWs,
                                  ",", kWs, String(0, -1), kWs, ":", kWs, inner, ")*)?", kWs,
                                  R"(\})"));
      alts.push_back(ArrayOf(inner, 0, -1));
    }
    return "(" + absl::StrJoin(alts, "|") + ")";
  }

  std::string AnyObject() const {
    const std::string inner = AnyValue(free_depth_ - 1);
    return absl::StrCat(R"(\{)", kWs, "(", String(0, -1), kWs, ":", kWs, inner, "(", kWs, ",", kWs,
                        String(0, -1), kWs, ":", kWs, inner, ")*)?", kWs, R"(\})");
  }

 private:
  static absl::Status Bad(const std::string& path, absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("json_schema at ", path, ": ", what));
  }
  static absl::Status Unserved(const std::string& path, absl::string_view what) {
    return absl::UnimplementedError(absl::StrCat(
        "json_schema at ", path, ": ", what, " is not supported by this server's guided decoding"));
  }

  static std::string String(int64_t min, int64_t max) {
    if (min == 0 && max < 0) return absl::StrCat("\"", kStringChar, "*\"");
    return absl::StrCat("\"", kStringChar, "{", min, ",", max < 0 ? "" : absl::StrCat(max), "}\"");
  }

  static std::string ArrayOf(const std::string& item, int64_t min, int64_t max) {
    // [ item (, item){min-1,max-1} ], the whole list optional when min is 0.
    const std::string more =
        absl::StrCat("(", kWs, ",", kWs, item, ")",
                     max < 0 ? absl::StrCat("{", std::max<int64_t>(min - 1, 0), ",}")
                             : absl::StrCat("{", std::max<int64_t>(min - 1, 0), ",",
                                            std::max<int64_t>(max - 1, 0), "}"));
    std::string list = absl::StrCat(item, more);
    if (max == 0) list.clear();
    if (min == 0 && max != 0) list = "(" + list + ")?";
    return absl::StrCat(R"(\[)", kWs, list, kWs, R"(\])");
  }

  static absl::StatusOr<int64_t> Count(const Json& s, const char* key, const std::string& path,
                                       int64_t default_value) {
    if (!s.contains(key)) return default_value;
    const Json& v = s[key];
    if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0)) {
      return Bad(path, absl::StrCat(key, " must be a non-negative integer"));
    }
    if (v.get<uint64_t>() > 10000) return Unserved(path, absl::StrCat(key, " above 10000"));
    return static_cast<int64_t>(v.get<uint64_t>());
  }

  absl::StatusOr<std::string> Dispatch(const Json& s, const std::string& path) {
    for (const auto& [key, value] : s.items()) {
      if (kServed.count(key) == 0 && kAnnotations.count(key) == 0) {
        return Unserved(path, absl::StrCat("the keyword \"", key, "\""));
      }
    }
    if (s.contains("$ref")) return Ref(s, path);
    if (s.contains("const")) {
      if (Depth(s["const"]) > kMaxLiteralDepth) return Unserved(path, "a const nested this deep");
      return Literal(s["const"]);
    }
    if (s.contains("enum")) {
      if (!s["enum"].is_array() || s["enum"].empty()) {
        return Bad(path, "enum must be a non-empty array");
      }
      std::vector<std::string> alts;
      for (const Json& v : s["enum"]) {
        if (Depth(v) > kMaxLiteralDepth) return Unserved(path, "an enum value nested this deep");
        alts.push_back(Literal(v));
      }
      return "(" + absl::StrJoin(alts, "|") + ")";
    }
    for (const char* key : {"anyOf", "oneOf"}) {
      if (!s.contains(key)) continue;
      if (!s[key].is_array() || s[key].empty()) {
        return Bad(path, absl::StrCat(key, " must be a non-empty array"));
      }
      std::vector<std::string> alts;
      for (size_t i = 0; i < s[key].size(); ++i) {
        absl::StatusOr<std::string> r = Value(s[key][i], absl::StrCat(path, "/", key, "/", i));
        if (!r.ok()) return r;
        alts.push_back(*std::move(r));
      }
      return "(" + absl::StrJoin(alts, "|") + ")";
    }
    if (s.contains("allOf")) {
      if (!s["allOf"].is_array() || s["allOf"].size() != 1) {
        return Unserved(path, "allOf with other than one schema");
      }
      return Value(s["allOf"][0], path + "/allOf/0");
    }
    if (!s.contains("type")) {
      // Only annotations: any value.
      return AnyValue(free_depth_);
    }
    const Json& type = s["type"];
    if (type.is_array()) {
      std::vector<std::string> alts;
      for (const Json& t : type) {
        Json one = s;
        one["type"] = t;
        absl::StatusOr<std::string> r = Value(one, path);
        if (!r.ok()) return r;
        alts.push_back(*std::move(r));
      }
      if (alts.empty()) return Bad(path, "type is an empty list");
      return "(" + absl::StrJoin(alts, "|") + ")";
    }
    if (!type.is_string()) return Bad(path, "type must be a string or a list of strings");
    const std::string t = type.get<std::string>();
    if (t == "string") return StringSchema(s, path);
    if (t == "integer") return std::string(kInteger);
    if (t == "number") return std::string(kNumber);
    if (t == "boolean") return std::string("(true|false)");
    if (t == "null") return std::string("null");
    if (t == "array") return ArraySchema(s, path);
    if (t == "object") return ObjectSchema(s, path);
    return Bad(path, absl::StrCat("unknown type \"", t, "\""));
  }

  absl::StatusOr<std::string> StringSchema(const Json& s, const std::string& path) {
    if (s.contains("pattern")) {
      if (!s["pattern"].is_string()) return Bad(path, "pattern must be a string");
      if (s.contains("minLength") || s.contains("maxLength") || s.contains("format")) {
        return Unserved(path, "pattern beside minLength, maxLength or format");
      }
      // The pattern describes the string's characters; it goes between the quotes as it is.
      std::string p = s["pattern"].get<std::string>();
      if (!p.empty() && p.front() == '^') p.erase(0, 1);
      if (!p.empty() && p.back() == '$' && (p.size() < 2 || p[p.size() - 2] != '\\')) p.pop_back();
      return absl::StrCat("\"(", p, ")\"");
    }
    if (s.contains("format")) {
      if (!s["format"].is_string()) return Bad(path, "format must be a string");
      const std::string f = s["format"].get<std::string>();
      if (f == "date")
        return std::string(R"re("[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])")re");
      if (f == "time") {
        return std::string(
            R"re("([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])?")re");
      }
      if (f == "date-time") {
        return std::string(
            R"re("[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])?")re");
      }
      if (f == "uuid") {
        return std::string(
            R"re("[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")re");
      }
      return Unserved(path, absl::StrCat("format \"", f, "\""));
    }
    absl::StatusOr<int64_t> min = Count(s, "minLength", path, 0);
    if (!min.ok()) return min.status();
    absl::StatusOr<int64_t> max = Count(s, "maxLength", path, -1);
    if (!max.ok()) return max.status();
    if (*max >= 0 && *max < *min) return Bad(path, "maxLength is below minLength");
    return String(*min, *max);
  }

  absl::StatusOr<std::string> ArraySchema(const Json& s, const std::string& path) {
    absl::StatusOr<int64_t> min = Count(s, "minItems", path, 0);
    if (!min.ok()) return min.status();
    absl::StatusOr<int64_t> max = Count(s, "maxItems", path, -1);
    if (!max.ok()) return max.status();
    if (*max >= 0 && *max < *min) return Bad(path, "maxItems is below minItems");
    if (s.contains("prefixItems")) return Unserved(path, "prefixItems");
    std::string item;
    if (s.contains("items")) {
      absl::StatusOr<std::string> r = Value(s["items"], path + "/items");
      if (!r.ok()) return r;
      item = *std::move(r);
    } else {
      item = AnyValue(free_depth_ - 1);
    }
    return ArrayOf(item, *min, *max);
  }

  absl::StatusOr<std::string> ObjectSchema(const Json& s, const std::string& path) {
    const Json properties = s.value("properties", Json::object());
    if (!properties.is_object()) return Bad(path, "properties must be an object");
    const Json required = s.value("required", Json::array());
    if (!required.is_array()) return Bad(path, "required must be an array");
    std::set<std::string> needed;
    for (const Json& r : required) {
      if (!r.is_string()) return Bad(path, "required must list strings");
      if (!properties.contains(r.get<std::string>())) {
        return Unserved(path, absl::StrCat("a required property without a schema (\"",
                                           r.get<std::string>(), "\")"));
      }
      needed.insert(r.get<std::string>());
    }
    if (properties.empty()) {
      const Json extra = s.value("additionalProperties", Json(true));
      if (extra.is_boolean() && !extra.get<bool>()) return absl::StrCat(R"(\{)", kWs, R"(\})");
      if (extra.is_boolean()) return AnyObject();
      absl::StatusOr<std::string> value = Value(extra, path + "/additionalProperties");
      if (!value.ok()) return value;
      const std::string entry = absl::StrCat(String(0, -1), kWs, ":", kWs, *value);
      return absl::StrCat(R"(\{)", kWs, "(", entry, "(", kWs, ",", kWs, entry, ")*)?", kWs,
                          R"(\})");
    }
    // Properties in the schema's order; the ones not listed are never generated (valid whatever
    // additionalProperties says).
    std::vector<std::string> parts;
    std::vector<bool> is_required;
    for (const auto& [name, schema] : properties.items()) {
      absl::StatusOr<std::string> value = Value(schema, path + "/properties/" + name);
      if (!value.ok()) return value;
      parts.push_back(
          absl::StrCat(kWs, Escape(Json(name).dump()), kWs, ":", kWs, *std::move(value)));
      is_required.push_back(needed.count(name) > 0);
    }
    std::string body;
    const auto last = std::find(is_required.rbegin(), is_required.rend(), true);
    if (last != is_required.rend()) {
      const size_t last_required = static_cast<size_t>(is_required.rend() - last - 1);
      for (size_t i = 0; i < parts.size(); ++i) {
        std::string part = parts[i];
        if (i < last_required) part = absl::StrCat(part, kWs, ",");
        if (i > last_required) part = absl::StrCat(kWs, ",", part);
        body += is_required[i] ? part : "(" + part + ")?";
      }
    } else {
      // None required: one alternative per property as the first present.
      std::vector<std::string> alts;
      for (size_t i = 0; i < parts.size(); ++i) {
        std::string alt = parts[i];
        for (size_t j = i + 1; j < parts.size(); ++j) {
          absl::StrAppend(&alt, "(", kWs, ",", parts[j], ")?");
        }
        alts.push_back(alt);
      }
      body = "(" + absl::StrJoin(alts, "|") + ")?";
    }
    return absl::StrCat(R"(\{)", body, kWs, R"(\})");
  }

  absl::StatusOr<std::string> Ref(const Json& s, const std::string& path) {
    if (s.size() != 1 && !std::all_of(s.items().begin(), s.items().end(), [](const auto& kv) {
          return kv.key() == "$ref" || kAnnotations.count(kv.key()) > 0;
        })) {
      return Unserved(path, "$ref beside other keywords");
    }
    if (!s["$ref"].is_string()) return Bad(path, "$ref must be a string");
    const std::string ref = s["$ref"].get<std::string>();
    if (ref.rfind("#", 0) != 0) return Unserved(path, absl::StrCat("the remote $ref ", ref));
    if (std::find(refs_.begin(), refs_.end(), ref) != refs_.end()) {
      return Unserved(path, absl::StrCat("the recursive $ref ", ref));
    }
    const Json* target = &root_;
    if (ref.size() > 1) {
      const Json::json_pointer pointer(ref.substr(1));
      if (!root_.contains(pointer)) return Bad(path, absl::StrCat("$ref ", ref, " is not found"));
      target = &root_.at(pointer);
    }
    refs_.push_back(ref);
    absl::StatusOr<std::string> out = Value(*target, ref);
    refs_.pop_back();
    return out;
  }

  const Json& root_;
  int free_depth_;
  int nesting_ = 0;
  std::vector<std::string> refs_;  // the $refs being expanded (a cycle is refused)
};

}  // namespace

absl::StatusOr<ByteDfa> CompileJsonSchema(std::string_view schema_text) {
  Json schema = Json::parse(schema_text, nullptr, /*allow_exceptions=*/false);
  if (schema.is_discarded()) return absl::InvalidArgumentError("json_schema is not valid JSON");
  // Copies of a schema's parts (and their conversion) recurse: a document nested deeper than
  // any real schema is refused before either could exhaust the stack.
  constexpr int kMaxSchemaDepth = 128;
  if (Depth(schema, kMaxSchemaDepth) > kMaxSchemaDepth) {
    return absl::InvalidArgumentError(
        absl::StrCat("json_schema nests deeper than ", kMaxSchemaDepth, " levels"));
  }
  SchemaToRegex convert(schema, kFreeJsonDepth);
  absl::StatusOr<std::string> pattern;
  try {
    pattern = convert.Value(schema, "#");
  } catch (const nlohmann::json::exception& e) {  // a JSON pointer that does not parse
    return absl::InvalidArgumentError(absl::StrCat("json_schema: ", e.what()));
  }
  if (!pattern.ok()) return pattern.status();
  absl::StatusOr<ByteDfa> dfa = CompileRegex(*pattern);
  if (!dfa.ok() && dfa.status().code() == absl::StatusCode::kInvalidArgument &&
      dfa.status().message().find("too complex") != std::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat("json_schema: ", dfa.status().message()));
  }
  if (!dfa.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("json_schema: a pattern in it: ", dfa.status().message()));
  }
  return dfa;
}

absl::StatusOr<ByteDfa> CompileJsonObject() {
  static const Json kEmpty = Json::object();
  return CompileRegex(SchemaToRegex(kEmpty, kFreeJsonDepth).AnyObject());
}

}  // namespace tgis::grammar
