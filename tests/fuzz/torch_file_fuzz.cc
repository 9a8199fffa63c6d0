// A torch.save file's bytes (zip or legacy stream, and the pickle inside): prompt-tuning
// prefixes come from users, and nothing in a pickle may run or read out of bounds.
#include <cstdint>
#include <string_view>

#include "kernels/tensor.h"
#include "server/torch_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto tensors = tgis::server::ParseTorchFile(
      std::string_view(reinterpret_cast<const char*>(data), size), "fuzz.pt");
  if (!tensors.ok()) return 0;
  for (const auto& [name, t] : *tensors) {
    // As a prefix is loaded: converted to the model's dtype.
    if (t.bytes.size() <= (1u << 16)) {
      (void)tgis::server::ToFloatTensor(t, tgis::kernels::DType::kF32, name);
    }
  }
  return 0;
}
