// A safetensors file's bytes: the header (JSON, dtypes, shapes, offsets) is untrusted input.
#include <cstdint>

#include "kernels/tensor.h"
#include "server/weights.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto tensors = tgis::server::ParseSafetensors(data, size, "fuzz.safetensors", nullptr);
  if (!tensors.ok()) return 0;
  for (const auto& [name, t] : *tensors) {
    // Every byte a view claims must lie inside the input: read them all (AddressSanitizer
    // reports any that do not), and convert the small float ones as the loader would.
    const auto* p = static_cast<const uint8_t*>(t.raw());
    uint8_t sum = 0;
    for (size_t i = 0; i < t.nbytes(); ++i) sum ^= p[i];
    // Keeps the reads: an unused result would let the compiler drop them.
    asm volatile("" : : "r"(sum));
    const auto dtype = t.dtype();
    if (t.nbytes() <= (1u << 16) &&
        (dtype == tgis::kernels::DType::kBF16 || dtype == tgis::kernels::DType::kF16)) {
      (void)t.To(tgis::kernels::DType::kF32);
    }
  }
  return 0;
}
