// Mamba-2's selective scan on the CPU (ops.h's contract): the recurrence token by token. The
// convolution reads inputs only, so it runs first over every token; then each (sequence, head)
// pair, whose state is its own, runs over its tokens side by side with the others.
#include <cmath>
#include <cstring>

#include "kernels/check.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/thread_pool.h"

namespace tgis::kernels::cpu {

namespace {

// torch.nn.functional.softplus (beta 1, threshold 20).
float Softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }
float Silu(float x) { return x / (1.0f + std::exp(-x)); }

}  // namespace

void SelectiveScan(const SsmConfig& cfg, const Tensor& proj, const Tensor& conv_w,
                   const Tensor& conv_b, const Tensor& dt_bias, const Tensor& a_log,
                   const Tensor& d, const std::vector<int32_t>& query_start,
                   const std::vector<Tensor*>& conv_states, const std::vector<Tensor*>& ssm_states,
                   const std::vector<uint8_t>& fresh, Tensor* out) {
  const int64_t heads = cfg.heads, p = cfg.head_dim, groups = cfg.groups, n = cfg.state_size;
  const int64_t k = cfg.conv_kernel, inner = heads * p, channels = inner + 2 * groups * n;
  const int64_t width = inner + channels + heads;
  const size_t seqs = query_start.size() - 1;  // shapes checked by kernels::SelectiveScan
  TGIS_CHECK(proj.dtype() == DType::kF32 && conv_w.dtype() == DType::kF32 &&
                 (!conv_b.defined() || conv_b.dtype() == DType::kF32) &&
                 dt_bias.dtype() == DType::kF32 && a_log.dtype() == DType::kF32 &&
                 d.dtype() == DType::kF32,
             "SelectiveScan: f32 activations and parameters expected on the CPU");
  const float* w = conv_w.data<float>();
  const float* bias = conv_b.defined() ? conv_b.data<float>() : nullptr;
  const float* dtb = dt_bias.data<float>();
  const float* alog = a_log.data<float>();
  const float* dd = d.data<float>();
  const float* in = proj.data<float>();
  float* y_out = out->data<float>();
  const int64_t heads_per_group = heads / groups;
  const int64_t t_total = proj.dim(0);
  // The convolution first, every sequence's tokens in order (it reads inputs, not states):
  // xBC for every row. Then the heads, each on its own over its sequence's tokens, side by side.
  std::vector<float> xbc_all(static_cast<size_t>(t_total * channels));
  ParallelFor(static_cast<int64_t>(seqs), 1, [&](int64_t sb, int64_t se) {
    for (int64_t s = sb; s < se; ++s) {
      float* conv = conv_states[s]->data<float>();  // [C, K - 1], oldest first
      if (fresh[s]) {
        if (k > 1) std::memset(conv, 0, sizeof(float) * channels * (k - 1));  // K 1: none
        std::memset(ssm_states[s]->data<float>(), 0, sizeof(float) * heads * p * n);
      }
      for (int32_t t = query_start[s]; t < query_start[s + 1]; ++t) {
        const float* raw = in + t * width + inner;
        float* xbc = xbc_all.data() + t * channels;
        for (int64_t c = 0; c < channels; ++c) {
          float* past = conv + c * (k - 1);
          const float* wc = w + c * k;
          float acc = 0;
          for (int64_t j = 0; j < k - 1; ++j) acc += wc[j] * past[j];
          acc += wc[k - 1] * raw[c];
          if (bias != nullptr) acc += bias[c];
          xbc[c] = Silu(acc);
          if (k > 1) {
            std::memmove(past, past + 1, sizeof(float) * (k - 2));
            past[k - 2] = raw[c];
          }
        }
        std::memcpy(y_out + t * 2 * inner, in + t * width, sizeof(float) * inner);  // z | y
      }
    }
  });
  ParallelFor(static_cast<int64_t>(seqs) * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / heads, h = task % heads, g = h / heads_per_group;
      float* ssm = ssm_states[s]->data<float>() + h * p * n;  // [P, N] of [heads, P, N]
      for (int32_t t = query_start[s]; t < query_start[s + 1]; ++t) {
        const float* x = xbc_all.data() + t * channels;
        const float* bg = x + inner + g * n;
        const float* cg = x + inner + groups * n + g * n;
        const float dt = Softplus(in[t * width + inner + channels + h] + dtb[h]);
        const float decay = std::exp(dt * -std::exp(alog[h]));
        float* y = y_out + t * 2 * inner + inner + h * p;
        for (int64_t i = 0; i < p; ++i) {
          const float xi = x[h * p + i];
          // The state never overlaps B (the convolution's scratch): said, so the vectorized
          // update needs no run-time overlap check. (At -O2 GCC 12 vectorizes no loop of a
          // run-time length: the update stayed scalar, ~70% of the scan in perf; this file is
          // built at -O3, kernels/CMakeLists.txt.)
          float* __restrict state = ssm + i * n;
          const float* __restrict b_row = bg;
          // The update, then the read-out, each a loop the compiler vectorizes: the read-out
          // sums in 8 interleaved partial sums, added in a fixed order (the same bits whatever
          // the batch, the chunks or the threads).
          for (int64_t j = 0; j < n; ++j) state[j] = state[j] * decay + dt * b_row[j] * xi;
          float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
          int64_t j = 0;
          for (; j + 8 <= n; j += 8) {
            for (int l = 0; l < 8; ++l) part[l] += state[j + l] * cg[j + l];
          }
          for (; j < n; ++j) part[0] += state[j] * cg[j];
          const float acc = ((part[0] + part[1]) + (part[2] + part[3])) +
                            ((part[4] + part[5]) + (part[6] + part[7]));
          y[i] = acc + dd[h] * xi;
        }
      }
    }
  });
}

}  // namespace tgis::kernels::cpu
