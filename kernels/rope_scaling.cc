// Each expression below follows one torch op of modeling_rope_utils: a Python float meeting an
// f32 tensor becomes f32, every op rounds to f32, and this library is built with
// -ffp-contract=off so that nothing is fused.
#include "kernels/rope_scaling.h"

#include <algorithm>
#include <cmath>

#include "kernels/ops.h"

namespace tgis::kernels {

namespace {

float PowF32(float base, float exp) {
  return static_cast<float>(std::pow(static_cast<double>(base), static_cast<double>(exp)));
}

// base ** (torch.arange(0, dim, 2).float() / dim), in f32.
std::vector<float> PosFreqs(int dim, double theta) {
  std::vector<float> out(dim / 2);
  for (int i = 0; i < dim / 2; ++i) {
    out[i] = PowF32(static_cast<float>(theta), static_cast<float>(2 * i) / static_cast<float>(dim));
  }
  return out;
}

std::vector<float> Yarn(const RopeScaling& s) {
  const int dim = s.rotary_dim, half = dim / 2;
  const std::vector<float> pos = PosFreqs(dim, s.theta);
  const float factor = static_cast<float>(s.factor);
  // find_correction_range, in Python doubles.
  const double orig = static_cast<double>(s.original_max_positions);
  auto correction_dim = [&](double rotations) {
    return (dim * std::log(orig / (rotations * 2 * M_PI))) / (2 * std::log(s.theta));
  };
  double low = correction_dim(s.beta_fast), high = correction_dim(s.beta_slow);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(dim - 1));
  if (low == high) high += 0.001;  // linear_ramp_factor's guard against a zero range
  const float lo = static_cast<float>(low), range = static_cast<float>(high - low);
  std::vector<float> inv(half);
  for (int i = 0; i < half; ++i) {
    const float extrapolation = 1.0f / pos[i];
    const float interpolation = 1.0f / (factor * pos[i]);
    const float ramp = std::clamp((static_cast<float>(i) - lo) / range, 0.0f, 1.0f);
    const float extrapolation_factor = 1.0f - ramp;
    inv[i] = interpolation * (1.0f - extrapolation_factor) + extrapolation * extrapolation_factor;
  }
  return inv;
}

}  // namespace

std::vector<float> RopeScaling::InvFreq(int64_t length) const {
  switch (type) {
    case Type::kDefault:
      return RotaryInvFreq(rotary_dim, theta);
    case Type::kLinear: {
      std::vector<float> inv = RotaryInvFreq(rotary_dim, theta);
      for (float& f : inv) f /= static_cast<float>(factor);
      return inv;
    }
    case Type::kDynamic: {
      // base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2)) in doubles,
      // seq_len never below the original context.
      const double len = static_cast<double>(std::max(length, original_max_positions));
      const double orig = static_cast<double>(original_max_positions);
      const double dim = rotary_dim;
      const double base = theta * std::pow(factor * len / orig - (factor - 1), dim / (dim - 2));
      return RotaryInvFreq(rotary_dim, base);
    }
    case Type::kYarn:
      return Yarn(*this);
    case Type::kLongRope: {
      const std::vector<double>& ext = length > original_max_positions ? long_factor : short_factor;
      const std::vector<float> pos = PosFreqs(rotary_dim, theta);
      std::vector<float> inv(pos.size());
      for (size_t i = 0; i < pos.size(); ++i) {
        inv[i] = 1.0f / (static_cast<float>(ext[i]) * pos[i]);
      }
      return inv;
    }
    case Type::kLlama3:
      return RotaryInvFreq(rotary_dim, theta, factor, low_freq_factor, high_freq_factor,
                           static_cast<int>(original_max_positions));
  }
  return {};
}

}  // namespace tgis::kernels
