#include "server/moe.h"

#include <cmath>

#include "kernels/ops.h"
#include "kernels/tensor.h"
#include "server/decoder_model.h"

namespace tgis::server {

using kernels::Device;
using kernels::DType;
using kernels::Tensor;

namespace {

// exp(x - max) / sum over `v`, in f32 as torch's softmax(dtype=float) computes it.
void SoftmaxInPlace(std::vector<float>* v) {
  float mx = -INFINITY;
  for (float x : *v) mx = std::fmax(mx, x);
  float sum = 0;
  for (float& x : *v) sum += (x = std::exp(x - mx));
  for (float& x : *v) x /= sum;
}

// The k largest of `v`, largest first (ties: the lower index). A NaN never compares larger, so
// rows with one still pick k distinct experts.
std::vector<int32_t> TopK(const std::vector<float>& v, int64_t k) {
  std::vector<int32_t> picked;
  std::vector<bool> taken(v.size(), false);
  for (int64_t n = 0; n < k; ++n) {
    int32_t best = -1;
    for (size_t i = 0; i < v.size(); ++i) {
      if (!taken[i] && (best < 0 || v[i] > v[best])) best = static_cast<int32_t>(i);
    }
    taken[best] = true;
    picked.push_back(best);
  }
  return picked;
}

}  // namespace

std::vector<ExpertRows> RouteTokens(std::span<const float> scores, int64_t tokens, int64_t experts,
                                    int64_t k, ExpertRouting routing) {
  const bool softmax_first = routing != ExpertRouting::kTopKSoftmax;
  std::vector<ExpertRows> out(experts);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<float> row(scores.begin() + t * experts, scores.begin() + (t + 1) * experts);
    if (softmax_first) SoftmaxInPlace(&row);
    const std::vector<int32_t> best = TopK(row, k);
    std::vector<float> w;
    for (int32_t e : best) w.push_back(row[e]);
    if (routing == ExpertRouting::kSoftmaxTopKRenormalized) {
      float sum = 0;
      for (float x : w) sum += x;
      for (float& x : w) x /= sum;
    } else if (routing == ExpertRouting::kTopKSoftmax) {
      SoftmaxInPlace(&w);
    }
    for (size_t i = 0; i < best.size(); ++i) {
      out[best[i]].rows.push_back(static_cast<int32_t>(t));
      out[best[i]].weights.push_back(w[i]);
    }
  }
  return out;
}

void CausalLM::MixtureOfExperts(const LayerWeights& w, const Tensor& x, Tensor* out) const {
  const int64_t t = x.dim(0), experts = spec_.num_experts;
  const bool shared = w.shared_up.defined();
  const bool gated = shared && spec_.shared_expert_gated;
  const int64_t columns = experts + (gated ? 1 : 0);  // the shared expert's gate last
  Tensor scores = Buf({t, columns});
  kernels::Linear(x, w.router_w, w.router_b.defined() ? &w.router_b : nullptr, &scores);
  Tensor host = device_ == Device::kCpu ? scores : scores.ToDevice(Device::kCpu);
  if (host.dtype() != DType::kF32) host = host.To(DType::kF32);
  const float* s = host.data<float>();
  std::vector<float> router;  // [t, experts]
  // The shared expert takes every row, weighted by sigmoid(its gate's score) or 1, after the
  // others, as transformers adds it.
  ExpertRows shared_rows;
  for (int64_t i = 0; i < t; ++i) {
    router.insert(router.end(), s + i * columns, s + i * columns + experts);
    if (!shared) continue;
    shared_rows.rows.push_back(static_cast<int32_t>(i));
    shared_rows.weights.push_back(gated ? 1.0f / (1.0f + std::exp(-s[i * columns + experts]))
                                        : 1.0f);
  }
  std::vector<ExpertRows> routes =
      RouteTokens(router, t, experts, spec_.experts_per_token, spec_.routing);
  if (shared) routes.push_back(std::move(shared_rows));
  *out = Tensor::Zeros({t, spec_.hidden}, act_dtype_, device_);
  // Every expert's rows and weights end to end, sent to the device in one copy each.
  std::vector<int32_t> all_rows;
  std::vector<float> all_weights;
  for (const ExpertRows& r : routes) {
    all_rows.insert(all_rows.end(), r.rows.begin(), r.rows.end());
    all_weights.insert(all_weights.end(), r.weights.begin(), r.weights.end());
  }
  const auto n_all = static_cast<int64_t>(all_rows.size());
  Tensor rows = Tensor::FromVector(all_rows, {n_all});
  Tensor weights = Tensor::FromVector(all_weights, {n_all});
  if (device_ != Device::kCpu) {
    rows = rows.ToDevice(device_);
    weights = weights.ToDevice(device_);
  }
  int64_t begin = 0;
  for (size_t e = 0; e < routes.size(); ++e) {
    const int64_t n = static_cast<int64_t>(routes[e].rows.size());
    if (n == 0) continue;
    const bool is_shared = static_cast<int64_t>(e) == experts;
    const Tensor expert_rows = rows.Rows(begin, begin + n);
    Tensor xe = x;  // every row in order (a decode step of one sequence, the shared expert)
    if (n != t) {
      xe = Buf({n, spec_.hidden});
      kernels::Embedding(expert_rows, x, &xe);
    }
    Tensor ye = Buf({n, spec_.hidden});
    if (is_shared) {
      DenseMlp(w.shared_up, Tensor(), w.shared_down, Tensor(), layout_.shared_expert.size(), xe,
               &ye);
    } else {
      const bool biased = !w.expert_up_b.empty();
      DenseMlp(w.expert_up[e], biased ? w.expert_up_b[e] : Tensor(), w.expert_down[e],
               biased ? w.expert_down_b[e] : Tensor(), layout_.intermediate.size(), xe, &ye);
    }
    kernels::AddWeightedRows(ye, expert_rows, weights.Rows(begin, begin + n), out);
    begin += n;
  }
}

}  // namespace tgis::server
