// Linear weights quantized along their input dimension: GPTQ, AWQ and int8 absmax all reduce
// to unsigned integer codes with a scale and an integer zero point per (output row, group of
// input columns): w[n, k] = (code[n, k] - zero[n, g(k)]) * scale[n, g(k)].
//
// One stored layout serves every format, chosen so that kernels stream rows as they stream a
// dense [out, in] weight: codes are row-major [out, stored_in]; the input columns are stored
// group by group ("runs"), each run padded to a multiple of 8 columns, so every block of 8
// stored columns has one scale and one zero per row. When the groups are not contiguous
// ranges of columns (GPTQ act-order, or a tensor-parallel slice of one), `gather` says which
// input column each stored column reads; Linear gathers x accordingly (padding reads 0).
//
// The kernels dequantize in registers and sum in f32, so a quantized Linear equals, up to
// summation order, a dense f32 Linear on Dequantize(w): the reference that transformers runs.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "kernels/tensor.h"

namespace tgis::kernels {

namespace cpu {
struct CodePanels;  // kernels/cpu/linear_stream.h
}

// A layout of a weight's codes that a CPU kernel derives from them once and keeps with the
// weight: 8- and 4-bit codes interleaved 8 rows at a time (cpu::CodePanels), which exact decode
// on AVX2 reads, and for 4-bit codes the int8-activation kernels too. Made at load
// (PrepareCpuWeight) or else on first use. A copy of the weight starts without it, so that no
// layout outlives the codes it was made from (ShareFrom aside).
class DerivedCpuLayout {
 public:
  DerivedCpuLayout() = default;
  DerivedCpuLayout(const DerivedCpuLayout&) {}
  DerivedCpuLayout& operator=(const DerivedCpuLayout&) { return *this; }

  // The layout, made by `build` (returning a shared_ptr, or null where the weight has none) on
  // the first call only; callers at the same time wait for it.
  template <typename Build>
  const cpu::CodePanels* Panels(Build build) const {
    std::call_once(once_, [&] { panels_ = build(); });
    return panels_.get();
  }
  // Whether it has been made (tests; not synchronized with a concurrent first use).
  bool made() const { return panels_ != nullptr; }
  // This weight's layout is `other`'s (made from the same codes): for a copy that replaces the
  // weight it was made from.
  void ShareFrom(const DerivedCpuLayout& other) {
    std::call_once(once_, [&] { panels_ = other.panels_; });
  }

 private:
  mutable std::once_flag once_;
  mutable std::shared_ptr<const cpu::CodePanels> panels_;
};

struct QuantizedWeight {
  int bits = 8;  // 4 or 8: codes are in [0, 2^bits)
  // Codes are float8 e4m3fn bytes (fp8 checkpoints; bits 8, zeros 0):
  // w = Fp8E4M3ToF32(code) * scale.
  bool fp8 = false;
  // 4-bit codes that index a table of 16 values (bitsandbytes' nf4 and fp4), zeros 0:
  // w = codebook[code] * scale. Empty for integer codes.
  std::vector<float> codebook;
  int64_t out = 0;        // the dense weight's rows
  int64_t in = 0;         // the dense weight's columns (x's features)
  int64_t stored_in = 0;  // stored columns: runs padded to multiples of 8
  Tensor codes;           // [out, stored_in * bits / 8] kI8 (bytes); 4-bit: low nibble first
  // [out, runs] f32; or, compact, kF16 (see below)
  Tensor scales;
  // [out, runs] f32, integer-valued; or, compact, kI8 holding unsigned bytes
  Tensor zeros;
  Tensor block_run;  // [stored_in / 8] kI32: the run of each block of 8 stored columns
  Tensor gather;     // [stored_in] kI32 input column or -1 (padding); undefined: identity
  DerivedCpuLayout cpu_layout;
  // The codes live only in cpu_layout's 8-row panels: PrepareCpuWeight let the row-major copy
  // go, with the run constants the panels hold too (`codes` is then an empty CPU tensor,
  // `scales` and `zeros` undefined), where every CPU kernel path for the weight reads the
  // panels. Only those kernels can use the weight then (not Dequantize, nor another device).
  bool codes_only_in_panels = false;
  // What the CUDA tensor-core GEMV needs to know, found by QuantizedToDevice on the host copy
  // when the weight moves to CUDA: every run starts at a multiple of `run_alignment` stored
  // columns (a power of two, 8 to 128), and every zero is an integer in [0, max_zero] (-1: some
  // zero is not a non-negative integer).
  int64_t run_alignment = 8;
  int64_t max_zero = -1;

  int64_t runs() const { return scales.defined() ? scales.dim(1) : 0; }
  // Compact run constants: 4-bit weights whose every scale is an f16 value and every zero an
  // integer in [0, 255] (GPTQ and AWQ write f16 scales and integer zeros) keep them as f16 and
  // a byte, 3 bytes a run instead of 8, the same values exactly. Decode streams them with the
  // codes, and for groups of 32 they were a third of the bytes (f32 scale and zero per 16
  // bytes of codes); BuildQuantized chooses it, and every reader takes both forms.
  bool compact() const { return scales.defined() && scales.dtype() == DType::kF16; }
  int64_t code_bytes_per_row() const { return stored_in * bits / 8; }
};

// Builds the stored layout from codes in the dense layout: `codes` [out * in] (one code per
// byte, row-major), `group` [in] (the group of each input column, any order), `scales` and
// `zeros` [out * groups] (row-major, f32). Columns keep their order within a group; groups
// are stored in increasing index order (empty groups are dropped).
QuantizedWeight BuildQuantized(int bits, int64_t out, int64_t in, const std::vector<uint8_t>& codes,
                               const std::vector<int32_t>& group, int64_t groups,
                               const std::vector<float>& scales, const std::vector<float>& zeros);

// Rows stacked in order (q | k | v, gate | up): every part must have the same bits, columns,
// runs and gather (the same groups), else it fails naming nothing: callers check Compatible.
bool QuantizedCompatible(const QuantizedWeight& a, const QuantizedWeight& b);
QuantizedWeight ConcatQuantizedRows(const std::vector<const QuantizedWeight*>& parts);

// The dense f32 [out, in] weight the codes stand for (CPU; tests and references).
Tensor Dequantize(const QuantizedWeight& q);

// Weight-only int8 as `--quantize bitsandbytes` asks: per output row, scale = absmax / 127 and
// code = round(w / scale) + 128 with zero 128 (symmetric). `w` is a dense [out, in] CPU weight;
// `row_absmax` (one per row), when given, is of the whole row that `w` is columns of, so that a
// tensor-parallel slice is quantized as the whole row is. Rows must be finite: a row holding a
// NaN or an infinity has no int8 form; its index goes to *nonfinite_row (the first such row;
// the weight returned is then meaningless) or, without that pointer, fails a check.
QuantizedWeight QuantizeInt8Rows(const Tensor& w, const std::vector<float>* row_absmax = nullptr,
                                 int64_t* nonfinite_row = nullptr);

// bitsandbytes' quantize_4bit on whole rows of a dense [out, in] CPU weight: per block of
// `block` columns, absmax ([out, in / block], into *absmax) and, per weight, the index into
// `table` (16 values) of the value nearest w / absmax clamped to [-1, 1], a value on a
// midpoint taking the lower one as torch.bucketize does (into *codes, [out * in]). `in` must be
// a multiple of `block`. Rows over the CPU threads. A row holding a NaN or an infinity has no
// such form: false, and its index (the first such row) in *nonfinite_row.
bool QuantizeBlocks4(const Tensor& w, int64_t block, const std::vector<float>& table,
                     std::vector<uint8_t>* codes, std::vector<float>* absmax,
                     int64_t* nonfinite_row);

// An fp8 weight: `codes` [out * in] float8 e4m3fn bytes (no NaN), one scale per row.
QuantizedWeight BuildFp8Rows(int64_t out, int64_t in, const std::vector<uint8_t>& codes,
                             const std::vector<float>& row_scales);
// An fp8 weight with a scale per row and group of input columns (fp8 blocks: every row of a
// block of rows has its block's scales), `group` and `scales` as BuildQuantized takes them.
QuantizedWeight BuildFp8(int64_t out, int64_t in, const std::vector<uint8_t>& codes,
                         const std::vector<int32_t>& group, int64_t groups,
                         const std::vector<float>& scales);

// A 4-bit weight whose codes index `codebook` (16 values): w = codebook[code] * scale, the
// scale per row and group; `codes`, `group`, `groups` and `scales` as BuildQuantized takes them.
QuantizedWeight BuildCodebook4(int64_t out, int64_t in, const std::vector<uint8_t>& codes,
                               const std::vector<int32_t>& group, int64_t groups,
                               const std::vector<float>& scales,
                               const std::vector<float>& codebook);

// The same weight on `device` (every component copied). The CUDA kernels read f32 run
// constants, so a compact weight goes there with them widened (ExpandRunConstants).
QuantizedWeight QuantizedToDevice(const QuantizedWeight& q, Device device);
// Sets q's run_alignment and max_zero from its block_run and f32 zeros when they are on the
// host (else leaves them); QuantizedToDevice calls it for CUDA.
void FindRunFacts(QuantizedWeight* q);

// The same weight with f32 scales and zeros (a copy sharing the codes; as is if not compact).
QuantizedWeight ExpandRunConstants(const QuantizedWeight& q);

// Run r's scale and zero of row n (CPU; any form).
float RunScale(const QuantizedWeight& q, int64_t n, int64_t r);
float RunZero(const QuantizedWeight& q, int64_t n, int64_t r);

}  // namespace tgis::kernels
