#include "server/rope_config.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"

namespace tgis::server {

namespace {

using Json = nlohmann::json;
using kernels::RopeScaling;

absl::Status Bad(const std::string& key, const Json& value, const std::string& why) {
  return absl::InvalidArgumentError(
      absl::StrCat("config.json: rope_scaling.", key, " = ", value.dump(), ": ", why));
}

// A number of rope_scaling (or computed from one) as a position count: an error, not the
// undefined behaviour of casting a double beyond int64 (found by the model_config fuzz target).
absl::StatusOr<int64_t> Positions(const std::string& key, const Json& value, double positions) {
  if (!(positions >= 0 && positions < 9.2e18)) {
    return Bad(key, value, "gives a position count beyond any this server can hold");
  }
  return static_cast<int64_t>(positions);
}

// rope_scaling[key] as a number (a default when absent or null).
absl::StatusOr<double> Number(const Json& rs, const std::string& key,
                              std::optional<double> fallback) {
  auto it = rs.find(key);
  if (it == rs.end() || it->is_null()) {
    if (fallback) return *fallback;
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: rope_scaling.", key, ": missing (needed by this rope type)"));
  }
  if (!it->is_number()) return Bad(key, *it, "expected a number");
  return it->get<double>();
}

absl::StatusOr<std::vector<double>> Factors(const Json& rs, const std::string& key, int half) {
  auto it = rs.find(key);
  if (it == rs.end() || !it->is_array() || static_cast<int>(it->size()) != half) {
    return Bad(key, it == rs.end() ? Json() : *it,
               absl::StrCat("expected a list of rotary_dim / 2 = ", half, " numbers"));
  }
  std::vector<double> out;
  for (const Json& v : *it) {
    if (!v.is_number() || v.get<double>() <= 0) return Bad(key, *it, "expected positive numbers");
    out.push_back(v.get<double>());
  }
  return out;
}

// YaRN's default attention factor (get_mscale).
double Mscale(double scale, double mscale = 1) {
  return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

}  // namespace

absl::StatusOr<int> PartialRotaryDim(int64_t head_dim, double fraction, const char* key) {
  // (The model_config fuzz target found both: an odd count failed a kernel check, and a huge
  // fraction made the cast undefined.)
  const double rotary = static_cast<double>(head_dim) * fraction;
  if (!(rotary >= 2 && rotary <= static_cast<double>(head_dim)) ||
      static_cast<int>(rotary) % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: ", key, " = ", fraction, " gives head_dim ", head_dim, " x ", key, " = ",
        rotary,
        " rotary dimensions; their whole part must be even, non-zero and at most head_dim"));
  }
  return static_cast<int>(rotary);
}

absl::Status ReadRope(const ModelConfig& c, int rotary_dim, double theta, DecoderSpec* s) {
  RopeScaling r;
  r.theta = theta;
  r.rotary_dim = rotary_dim;
  r.original_max_positions = c.max_position_embeddings;
  // The served context: max_position_embeddings, times the factor for the scalings that
  // stretch it.
  double max_positions = static_cast<double>(c.max_position_embeddings);
  if (rotary_dim <= 0 || rotary_dim % 2 != 0 || rotary_dim > s->head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("config.json: the rotary dimension ", rotary_dim,
                                                   " must be even and at most head_dim ",
                                                   s->head_dim));
  }
  auto it = c.raw.find("rope_scaling");
  if (it != c.raw.end() && !it->is_null()) {
    const Json& rs = *it;
    if (!rs.is_object()) return Bad("", rs, "expected an object");
    const Json& type_json = rs.contains("rope_type") ? rs["rope_type"] : rs.value("type", Json());
    if (!type_json.is_string()) return Bad("rope_type", type_json, "expected a string");
    const std::string type = type_json.get<std::string>();
    if (type != "default") {
      auto factor =
          Number(rs, "factor", type == "longrope" ? std::optional<double>(1.0) : std::nullopt);
      if (!factor.ok()) return factor.status();
      if (*factor <= 0) return Bad("factor", rs["factor"], "must be positive");
      r.factor = *factor;
    }
    if (type == "default") {
    } else if (type == "linear") {
      r.type = RopeScaling::Type::kLinear;
      max_positions = c.max_position_embeddings * r.factor;
    } else if (type == "dynamic") {
      r.type = RopeScaling::Type::kDynamic;
      max_positions = c.max_position_embeddings * r.factor;
    } else if (type == "yarn") {
      r.type = RopeScaling::Type::kYarn;
      // transformers >= 4.50: a rope_scaling.original_max_position_embeddings is the
      // pre-training context, and the factor is max_position_embeddings over it.
      if (auto o = rs.find("original_max_position_embeddings"); o != rs.end() && !o->is_null()) {
        if (!o->is_number_integer() || o->get<int64_t>() <= 0) {
          return Bad("original_max_position_embeddings", *o, "expected a positive integer");
        }
        r.original_max_positions = o->get<int64_t>();
        r.factor = static_cast<double>(c.max_position_embeddings) /
                   static_cast<double>(r.original_max_positions);
      } else {
        max_positions = c.max_position_embeddings * r.factor;
      }
      auto fast = Number(rs, "beta_fast", 32.0), slow = Number(rs, "beta_slow", 1.0);
      if (!fast.ok()) return fast.status();
      if (!slow.ok()) return slow.status();
      r.beta_fast = *fast == 0 ? 32.0 : *fast;  // transformers: `get("beta_fast") or 32`
      r.beta_slow = *slow == 0 ? 1.0 : *slow;
      r.truncate = rs.value("truncate", true);
      auto af = Number(rs, "attention_factor", 0.0), ms = Number(rs, "mscale", 0.0),
           ms_all = Number(rs, "mscale_all_dim", 0.0);
      for (auto* v : {&af, &ms, &ms_all}) {
        if (!v->ok()) return v->status();
      }
      if (*af != 0) {
        r.attention_factor = *af;
      } else if (*ms != 0 && *ms_all != 0) {
        r.attention_factor = Mscale(r.factor, *ms) / Mscale(r.factor, *ms_all);
      } else {
        r.attention_factor = Mscale(r.factor);
      }
    } else if (type == "longrope" || type == "su") {
      r.type = RopeScaling::Type::kLongRope;
      auto sf = Factors(rs, "short_factor", rotary_dim / 2);
      if (!sf.ok()) return sf.status();
      auto lf = Factors(rs, "long_factor", rotary_dim / 2);
      if (!lf.ok()) return lf.status();
      r.short_factor = *sf;
      r.long_factor = *lf;
      // Phi-3 style: a top-level original_max_position_embeddings is the pre-training context
      // and max_position_embeddings the extended one.
      double factor = r.factor;
      if (auto o = c.raw.find("original_max_position_embeddings");
          o != c.raw.end() && !o->is_null()) {
        if (!o->is_number_integer() || o->get<int64_t>() <= 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("config.json: original_max_position_embeddings = ", o->dump(),
                           ": expected a positive integer"));
        }
        r.original_max_positions = o->get<int64_t>();
        factor = static_cast<double>(c.max_position_embeddings) /
                 static_cast<double>(r.original_max_positions);
      }
      auto af = Number(rs, "attention_factor", 0.0);
      if (!af.ok()) return af.status();
      if (*af != 0) {
        r.attention_factor = *af;
      } else {
        r.attention_factor =
            factor <= 1
                ? 1.0
                : std::sqrt(1 + std::log(factor) /
                                    std::log(static_cast<double>(r.original_max_positions)));
      }
    } else if (type == "llama3") {
      r.type = RopeScaling::Type::kLlama3;
      auto low = Number(rs, "low_freq_factor", std::nullopt);
      auto high = Number(rs, "high_freq_factor", std::nullopt);
      auto orig = Number(rs, "original_max_position_embeddings", std::nullopt);
      for (auto* v : {&low, &high, &orig}) {
        if (!v->ok()) return v->status();
      }
      if (*high <= *low)
        return Bad("high_freq_factor", rs["high_freq_factor"], "must exceed low_freq_factor");
      r.low_freq_factor = *low;
      r.high_freq_factor = *high;
      auto original = Positions("original_max_position_embeddings",
                                rs["original_max_position_embeddings"], *orig);
      if (!original.ok()) return original.status();
      r.original_max_positions = *original;
    } else {
      return Bad("rope_type", type_json,
                 "not supported (default, linear, dynamic, yarn, longrope and llama3 are)");
    }
  }
  if (r.original_max_positions <= 0 && r.type != RopeScaling::Type::kDefault &&
      r.type != RopeScaling::Type::kLinear) {
    return absl::InvalidArgumentError(
        "config.json: rope_scaling needs max_position_embeddings (the original context)");
  }
  s->position = PositionKind::kRotary;
  s->rotary.rotary_dim = rotary_dim;
  s->rotary.inv_freq = r.InvFreq(0);
  s->rope_by_length.reset();
  if (r.length_dependent()) s->rope_by_length = r;
  auto served = Positions(
      "factor", it != c.raw.end() && it->is_object() ? it->value("factor", Json()) : Json(),
      max_positions);
  if (!served.ok()) return served.status();
  s->max_positions = *served;
  if (r.attention_factor != 1) {
    // transformers multiplies cos and sin by the factor, so q.k grows by its square; with the
    // whole head rotated that is the same as scaling the attention logits.
    if (rotary_dim != s->head_dim) {
      return absl::UnimplementedError(
          "config.json: rope_scaling with an attention factor on a partial rotary dimension is "
          "not supported");
    }
    // On top of an architecture's own scale (Granite's attention_multiplier) where it has one.
    const double squared = r.attention_factor * r.attention_factor;
    s->attn_scale = static_cast<float>(s->attn_scale != 0
                                           ? squared * s->attn_scale
                                           : squared / std::sqrt(static_cast<double>(s->head_dim)));
  }
  return absl::OkStatus();
}

}  // namespace tgis::server
