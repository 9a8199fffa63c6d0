// Files written by PyTorch's torch.save: prompt-tuning prefixes (decoder.pt, encoder.pt, PEFT
// adapter_model.bin) and pytorch_model.bin checkpoints, read without Python or torch.
//
// Both formats are read: the zip archive of torch >= 1.6 (zip64 included) and the legacy
// stream of older releases (_use_new_zipfile_serialization=False). The pickle inside is read by
// a restricted unpickler that executes nothing: it knows tensors, storages, dicts and
// OrderedDicts, and refuses any other global (a pickled function or class) by name.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/tensor.h"

namespace tgis::server {

// One tensor as torch saved it, made contiguous. `dtype` is torch's name without "torch."
// (float32, float16, bfloat16, float64, int64, int32, int16, int8, uint8, bool, complex64,
// complex128, and uint16/uint32/uint64/float8_e4m3fn/float8_e5m2 of newer files), covering
// dtypes kernels::Tensor has no name for. `bytes` are little-endian, row-major.
struct TorchTensor {
  std::string dtype;
  std::vector<int64_t> shape;  // empty for a 0-dim tensor
  std::vector<uint8_t> bytes;
  // Where it lay in the file: tensors saved as views of one storage (tied weights) share it,
  // which is what a converter de-duplicates. Byte offsets are from the storage's start.
  std::string storage;         // the storage's key in the file
  int64_t storage_nbytes = 0;  // the whole storage
  int64_t first_byte = 0;      // [first_byte, end_byte): the bytes the tensor reaches
  int64_t end_byte = 0;
};

// What the file holds: a single tensor (key "") or a (possibly nested) dict of tensors whose
// keys are joined by ".", the way state dicts name them. Every error names the file; a value
// that is neither a tensor nor a dict (an int, a list, ...) is an error naming its key.
absl::StatusOr<std::map<std::string, TorchTensor>> ReadTorchFile(const std::string& path);
// The same from a whole file's bytes; `path` names it in errors.
absl::StatusOr<std::map<std::string, TorchTensor>> ParseTorchFile(std::string_view file,
                                                                  const std::string& path);

// A float tensor (float64/float32/float16/bfloat16) converted to `dtype` (kF32, kBF16 or
// kF16), rounding as torch's .to() does; a 0-dim tensor becomes shape [1]. Other dtypes are
// an error; `what` (e.g. "file: key") is put in front of error messages.
absl::StatusOr<kernels::Tensor> ToFloatTensor(const TorchTensor& t, kernels::DType dtype,
                                              const std::string& what = "");

}  // namespace tgis::server
