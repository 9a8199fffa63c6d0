// Rotary position embedding (with its HF-exact inv_freq) and ALiBi slopes.
//
// RotaryInvFreq and AlibiSlopes are host-side helpers shared by every device. They reproduce the
// float32 arithmetic of HF transformers step by step (each torch op rounds to f32); this file
// is compiled with -ffp-contract=off so that no step gets fused.
#include <cmath>

#include "kernels/cpu/common.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/rotary_rows.h"
#include "kernels/cpu/thread_pool.h"
#include "kernels/ops.h"

namespace tgis::kernels {

namespace {

// torch's pow on f32 operands: the exact power rounded once to f32.
float PowF32(float base, float exp) {
  return static_cast<float>(std::pow(static_cast<double>(base), static_cast<double>(exp)));
}

}  // namespace

std::vector<float> RotaryInvFreq(int rotary_dim, double theta, double llama3_factor,
                                 double low_freq_factor, double high_freq_factor,
                                 int original_max_positions) {
  TGIS_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0, "RotaryInvFreq: rotary_dim %d", rotary_dim);
  const int half = rotary_dim / 2;
  // _compute_default_rope_parameters:
  //   1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
  // `base ** t` casts the Python float base to f32; `1.0 / t` is t.reciprocal() * 1.0.
  const float base = static_cast<float>(theta);
  const float dim = static_cast<float>(rotary_dim);
  std::vector<float> inv(half);
  for (int i = 0; i < half; ++i) {
    const float e = static_cast<float>(2 * i) / dim;
    inv[i] = 1.0f / PowF32(base, e);
  }
  if (llama3_factor == 0) return inv;

  // _compute_llama3_parameters; every Python scalar meets an f32 tensor, so it becomes f32.
  const float factor = static_cast<float>(llama3_factor);
  const float low = static_cast<float>(low_freq_factor);
  const float old_len = static_cast<float>(original_max_positions);
  const float low_freq_wavelen = static_cast<float>(original_max_positions / low_freq_factor);
  const float high_freq_wavelen = static_cast<float>(original_max_positions / high_freq_factor);
  const float two_pi = static_cast<float>(2 * M_PI);
  const float high_minus_low = static_cast<float>(high_freq_factor - low_freq_factor);
  for (int i = 0; i < half; ++i) {
    const float f = inv[i];
    const float wavelen = (1.0f / f) * two_pi;  // 2 * math.pi / inv_freq
    float scaled = wavelen > low_freq_wavelen ? f / factor : f;
    // smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high - low)
    const float smooth = ((1.0f / wavelen) * old_len - low) / high_minus_low;
    // smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    const float smoothed = (1.0f - smooth) * scaled / factor + smooth * scaled;
    const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
    inv[i] = medium ? smoothed : scaled;
  }
  return inv;
}

std::vector<float> AlibiSlopes(int num_heads) {
  // BLOOM's build_alibi_tensor (MPT's gen_slopes gives the same values): with p the largest
  // power of two <= n, slopes base^1..base^p with base = 2^(-8/p), then for the remaining
  // heads extra_base^1, ^3, ^5, ... with extra_base = 2^(-4/p). Bases are f32 tensors and
  // torch.pow(f32, int) rounds the exact power to f32.
  TGIS_CHECK(num_heads > 0, "AlibiSlopes: num_heads %d", num_heads);
  int p = 1;
  while (p * 2 <= num_heads) p *= 2;
  std::vector<float> slopes;
  slopes.reserve(num_heads);
  const float base = static_cast<float>(std::pow(2.0, -std::pow(2.0, -(std::log2(p) - 3))));
  for (int i = 1; i <= p; ++i) slopes.push_back(static_cast<float>(std::pow(double{base}, i)));
  if (p != num_heads) {
    const float extra =
        static_cast<float>(std::pow(2.0, -std::pow(2.0, -(std::log2(2.0 * p) - 3))));
    const int remaining = std::min(p, num_heads - p);
    for (int i = 0; i < remaining; ++i)
      slopes.push_back(static_cast<float>(std::pow(double{extra}, 2 * i + 1)));
  }
  return slopes;
}

namespace cpu {

void CheckRotary(const RotaryConfig& cfg, int64_t d, const char* op) {
  const int rot = cfg.rotary_dim;
  TGIS_CHECK(rot > 0 && rot % 2 == 0 && rot <= d, "%s: rotary_dim %d with head_dim %lld", op, rot,
             static_cast<long long>(d));
  TGIS_CHECK(static_cast<int>(cfg.inv_freq.size()) == rot / 2,
             "%s: inv_freq has %zu entries, want %d", op, cfg.inv_freq.size(), rot / 2);
}

void RotaryAngles(const RotaryConfig& cfg, int64_t position, float* c, float* s) {
  // HF: freqs = inv_freq @ position (f32 product), then cos / sin in f32.
  const float pos = static_cast<float>(position);
  const int half = cfg.rotary_dim / 2;
  for (int j = 0; j < half; ++j) {
    const float f = pos * cfg.inv_freq[j];
    c[j] = std::cos(f);
    s[j] = std::sin(f);
  }
}

void RotateHead(const RotaryConfig& cfg, float* x, const float* c, const float* s) {
  const int half = cfg.rotary_dim / 2;
  if (cfg.style == RotaryStyle::kNeox) {
    for (int j = 0; j < half; ++j) {
      const float x1 = x[j];
      const float x2 = x[j + half];
      x[j] = x1 * c[j] - x2 * s[j];
      x[j + half] = x2 * c[j] + x1 * s[j];
    }
  } else {
    for (int j = 0; j < half; ++j) {
      const float x1 = x[2 * j];
      const float x2 = x[2 * j + 1];
      x[2 * j] = x1 * c[j] - x2 * s[j];
      x[2 * j + 1] = x2 * c[j] + x1 * s[j];
    }
  }
}

void Rotary(const RotaryConfig& cfg, const Tensor& positions, Tensor* q, Tensor* k) {
  CheckIndexTensor(positions, "Rotary", "positions");
  TGIS_CHECK(q != nullptr, "Rotary: q is null");
  CheckF32(*q, "Rotary", "q");
  const bool has_k = k != nullptr && k->defined();
  if (has_k) CheckF32(*k, "Rotary", "k");
  TGIS_CHECK(q->rank() == 3, "Rotary: q must be [T, Hq, D]");
  const int64_t t_count = q->dim(0);
  const int64_t d = q->dim(2);
  CheckRotary(cfg, d, "Rotary");
  TGIS_CHECK(positions.numel() == t_count, "Rotary: positions has %lld entries, want %lld",
             static_cast<long long>(positions.numel()), static_cast<long long>(t_count));
  if (has_k) {
    TGIS_CHECK(k->rank() == 3 && k->dim(0) == t_count && k->dim(2) == d,
               "Rotary: k must be [T, Hk, D] like q");
  }
  const int64_t hq = q->dim(1);
  const int64_t hk = has_k ? k->dim(1) : 0;
  const int half = cfg.rotary_dim / 2;
  float* qp = q->data<float>();
  float* kp = has_k ? k->data<float>() : nullptr;
  ParallelFor(t_count, 16, [&](int64_t b, int64_t e) {
    std::vector<float> cs(2 * half);
    float* c = cs.data();
    float* s = c + half;
    for (int64_t t = b; t < e; ++t) {
      RotaryAngles(cfg, IndexAt(positions, t), c, s);
      for (int64_t h = 0; h < hq; ++h) RotateHead(cfg, qp + (t * hq + h) * d, c, s);
      for (int64_t h = 0; h < hk; ++h) RotateHead(cfg, kp + (t * hk + h) * d, c, s);
    }
  });
}

}  // namespace cpu
}  // namespace tgis::kernels
