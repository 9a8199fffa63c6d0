// Safetensors checkpoints: one model.safetensors or a model.safetensors.index.json with shards,
// mapped into memory; tensors are handed out as views or converted copies.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/progress.h"
#include "kernels/tensor.h"
#include "server/quantization.h"

namespace tgis::server {

// The tensors of one safetensors file, as views of the mapped file.
absl::StatusOr<std::map<std::string, kernels::Tensor>> ReadSafetensorsFile(const std::string& path);
// The same from the `size` bytes of a whole safetensors file at `data` (`file` names it in
// errors); the tensors are views into `data` and keep `owner` alive.
absl::StatusOr<std::map<std::string, kernels::Tensor>> ParseSafetensors(
    const uint8_t* data, size_t size, const std::string& file, std::shared_ptr<void> owner);

// Tensor name prefixes read under another name: (prefix in the checkpoint, the name the model
// reads), the first that matches applies (a multimodal checkpoint's language model:
// LanguageModelSource).
using TensorRenames = std::vector<std::pair<std::string, std::string>>;

class WeightStore {
 public:
  // Opens every safetensors file of the folder (a bad header names the file and the tensor),
  // its tensors named as `renames` says.
  static absl::StatusOr<std::unique_ptr<WeightStore>> Open(const std::string& model_dir,
                                                           const TensorRenames& renames = {});

  bool Has(const std::string& name) const { return tensors_.count(name) > 0; }
  // The tensor converted to `dtype` (a view without copy when the dtype matches).
  absl::StatusOr<kernels::Tensor> Get(const std::string& name, kernels::DType dtype) const;
  // The tensor as stored: a view of the mapped file (for reading slices of it). A float8
  // tensor is an error unless `fp8_ok` (the fp8 linear loader, which has its scales).
  absl::StatusOr<kernels::Tensor> View(const std::string& name, bool fp8_ok = false) const;
  std::vector<std::string> Names() const;
  const std::string& dir() const { return dir_; }
  // The file that holds `name` ("" when there is no such tensor).
  std::string FileOf(const std::string& name) const;

  // Get and View record the names they hand out, so that a loader can tell which tensors of
  // the checkpoint nothing read (a model that leaves a tensor unread computes something else
  // than the checkpoint's authors meant). Safe to call from several threads (tensor-parallel
  // ranks in one process share a store).
  void MarkRead(const std::string& name) const;
  // Tensors nobody has read, in name order.
  std::vector<std::string> Unread() const;
  // Loading progress in the log: each tensor's first read counts its bytes (a mapped file is
  // read from disk when first touched, so this follows the real I/O). FinishLoading prints the
  // closing line.
  void FinishLoading() const;
  // After the model is built: drops the mapped files' pages from this process's memory
  // (madvise MADV_DONTNEED). What the model converted or copied (quantized layouts, another
  // dtype, weights moved to a GPU) no longer needs them, yet they stayed resident, counted in
  // the process's and the container's memory, as long as any view of the file lived. Views
  // the model kept stay valid and read their pages back from the page cache when touched.
  void ReleaseMappedPages() const;

  // How the checkpoint's linear weights are quantized (ReadQuantConfig; default: not).
  void set_quantization(QuantConfig q) { quant_ = std::move(q); }
  const QuantConfig& quantization() const { return quant_; }

 private:
  struct Entry {
    kernels::Tensor view;
    std::string file;
  };
  std::string dir_;
  QuantConfig quant_;
  std::map<std::string, Entry> tensors_;
  std::vector<std::pair<void*, size_t>> mapped_;  // each file's mapping, alive with the views
  mutable std::mutex read_mu_;
  mutable std::set<std::string> read_;
  std::unique_ptr<Progress> progress_;
};

}  // namespace tgis::server
