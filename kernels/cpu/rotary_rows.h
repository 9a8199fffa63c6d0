// The per-token steps of the CPU rotary embedding, shared by Rotary and QkvToCache so that
// both round alike (bit for bit).
#pragma once

#include <cstdint>

#include "kernels/ops.h"

namespace tgis::kernels::cpu {

// Checks cfg against head_dim d: rotary_dim even, positive, within d; inv_freq sized to match.
void CheckRotary(const RotaryConfig& cfg, int64_t d, const char* op);
// c[j], s[j] = cos and sin of the f32 product position * inv_freq[j], j < rotary_dim / 2 (HF's
// freqs, computed in f32).
void RotaryAngles(const RotaryConfig& cfg, int64_t position, float* c, float* s);
// Rotates one head's leading rotary_dim values in place by the angles RotaryAngles gave.
void RotateHead(const RotaryConfig& cfg, float* x, const float* c, const float* s);

}  // namespace tgis::kernels::cpu
