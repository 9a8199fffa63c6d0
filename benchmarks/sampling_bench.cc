// Host-side cost of choosing one token per vocabulary size and warper setting: from the whole
// row (Sampler::Next), and from its 1024 largest values (the engine's path for rows that are not
// plain greedy: TopLogits where the logits are, then Sampler::NextFromTop on the host; on CUDA
// only the latter runs on the host, after a copy of 1024 values and ids instead of the row).
//   sampling_bench [--vocab 32000,128256] [--reps 9]
// Prints the best of `reps` calls in milliseconds for random logits (normal, sigma 3).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kernels/ops.h"
#include "server/sampling.h"

int main(int argc, char** argv) {
  std::vector<int> vocabs = {32000, 128256};
  int reps = 9;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--vocab") {
      vocabs.clear();
      for (size_t pos = 0; pos < v.size();) {
        const size_t comma = std::min(v.find(',', pos), v.size());
        vocabs.push_back(std::atoi(v.substr(pos, comma - pos).c_str()));
        pos = comma + 1;
      }
    } else if (k == "--reps") {
      reps = std::max(1, std::atoi(v.c_str()));
    } else {
      std::fprintf(stderr, "usage: sampling_bench [--vocab 32000,128256] [--reps 9]\n");
      return 2;
    }
  }
  struct Setting {
    const char* name;
    bool sample;
    int top_k;
    float top_p, temperature;
  };
  const Setting settings[] = {{"sampling, temperature 0.8", true, 0, 1.0f, 0.8f},
                              {"sampling, top_p 0.9", true, 0, 0.9f, 1.0f},
                              {"sampling, top_k 50", true, 50, 1.0f, 1.0f},
                              {"greedy with a penalty", false, 0, 1.0f, 1.0f}};
  for (int vocab : vocabs) {
    std::mt19937 gen(1);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    std::vector<float> logits(vocab);
    for (float& x : logits) x = normal(gen);
    for (const Setting& s : settings) {
      tgis::server::SamplingParams p;
      p.do_sample = s.sample;
      p.top_k = s.top_k;
      p.top_p = s.top_p;
      p.temperature = s.temperature;
      p.repetition_penalty = s.sample ? 1.0f : 1.2f;
      p.seed = 3;
      tgis::server::Sampler sampler(p, {});
      const std::vector<int32_t> context = {1, 2, 3};
      double best = 1e30;
      for (int r = 0; r < reps; ++r) {
        std::vector<float> step = logits;
        const auto t0 = std::chrono::steady_clock::now();
        sampler.Next(step, context, 1, 0);
        best = std::min(
            best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                      .count());
      }
      // The path through the largest values (the repetition penalty would be applied where the
      // logits are; here it is left out of both timings).
      using tgis::kernels::Tensor;
      const float temperature = s.sample ? s.temperature : 1.0f;
      const int64_t count = std::min<int64_t>(1024, vocab);
      double best_top = 1e30, best_next = 1e30;
      int whole = 0;
      tgis::server::Sampler top(p, {});
      for (int r = 0; r < reps; ++r) {
        const Tensor row = Tensor::FromVector(logits, {1, vocab});
        Tensor values, ids, stats;
        const auto t0 = std::chrono::steady_clock::now();
        tgis::kernels::TopLogits(row, Tensor::FromVector(std::vector<int32_t>{0}, {1}),
                                 Tensor::FromVector(std::vector<float>{temperature}, {1}), count,
                                 &values, &ids, &stats);
        const auto t1 = std::chrono::steady_clock::now();
        const auto choice =
            top.NextFromTop(std::span<const float>(values.data<float>(), count),
                            std::span<const int32_t>(ids.data<int32_t>(), count),
                            stats.data<float>()[0], stats.data<float>()[1], vocab, 0);
        const auto t2 = std::chrono::steady_clock::now();
        whole += !choice.has_value();
        best_top = std::min(best_top, std::chrono::duration<double, std::milli>(t1 - t0).count());
        best_next = std::min(best_next, std::chrono::duration<double, std::milli>(t2 - t1).count());
      }
      std::printf(
          "vocab %6d  %-28s whole row %.2f ms | TopLogits (CPU) %.2f ms + NextFromTop %.3f ms"
          " (%d of %d reads the row)\n",
          vocab, s.name, best, best_top, best_next, whole, reps);
    }
  }
  return 0;
}
