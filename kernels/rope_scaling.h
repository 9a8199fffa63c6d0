// Rotary frequencies for every rope type of transformers' modeling_rope_utils (default, linear,
// dynamic NTK, YaRN, LongRoPE, Llama 3), reproducing its float32 arithmetic step by step so
// that positions far past the original context still match transformers to the last bit.
#pragma once

#include <cstdint>
#include <vector>

namespace tgis::kernels {

struct RopeScaling {
  enum class Type { kDefault, kLinear, kDynamic, kYarn, kLongRope, kLlama3 };
  Type type = Type::kDefault;
  double theta = 10000;
  int rotary_dim = 0;
  double factor = 1;
  // The context the model was pre-trained with (dynamic, YaRN, LongRoPE, Llama 3).
  int64_t original_max_positions = 0;
  double low_freq_factor = 1, high_freq_factor = 4;  // Llama 3
  double beta_fast = 32, beta_slow = 1;              // YaRN
  bool truncate = true;                              // YaRN: integer correction range
  std::vector<double> short_factor, long_factor;     // LongRoPE, rotary_dim / 2 each
  // What transformers multiplies cos and sin by (YaRN, LongRoPE; 1 for the others).
  double attention_factor = 1;

  // Dynamic NTK and LongRoPE recompute the frequencies from a sequence's length
  // (max(position) + 1) on every forward pass; keys already cached keep their rotation.
  bool length_dependent() const { return type == Type::kDynamic || type == Type::kLongRope; }
  // The frequencies for a sequence whose length so far is `length` (only length_dependent
  // types look at it; for them, lengths up to original_max_positions give the base ones).
  std::vector<float> InvFreq(int64_t length = 0) const;
};

}  // namespace tgis::kernels
