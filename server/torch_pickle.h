// A restricted unpickler for the pickles torch.save writes (internal to torch_file.cc;
// torch_pickle.cc runs the opcodes, torch_objects.cc gives the allowed globals their meaning).
//
// Nothing is executed: GLOBAL may only name a fixed allowlist (tensor rebuild functions,
// OrderedDict, torch storage classes and dtypes), and REDUCE/BUILD are interpreted for those
// names alone, the way torch's own weights_only unpickler restricts them. Tensors come out as
// descriptions (storage, offset, size, stride); their bytes are gathered later by the caller.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace tgis::server::torch_detail {

struct PyValue;
using PyRef = std::shared_ptr<PyValue>;

// A storage as a persistent id names it: `numel` elements of `dtype` under `key`, starting
// `offset` elements into that key's data (legacy storage views only; otherwise 0).
struct StorageRef {
  std::string key;
  std::string dtype;
  size_t elem_size = 0;
  int64_t numel = 0;
  int64_t offset = 0;
};

struct TensorRef {
  StorageRef storage;
  std::string dtype;  // differs from the storage's only for untyped storages (rebuild_tensor_v3)
  size_t elem_size = 0;
  int64_t offset = 0;  // in elements of `dtype`
  std::vector<int64_t> size;
  std::vector<int64_t> stride;
};

struct PyValue {
  enum class Kind {
    kNone,
    kBool,
    kInt,
    kBigInt,
    kFloat,
    kStr,
    kBytes,
    kTuple,
    kList,
    kDict,
    kGlobal,
    kStorage,
    kTensor
  };
  Kind kind = Kind::kNone;
  int64_t i = 0;  // kBool, kInt
  double f = 0;   // kFloat
  // kStr, kBytes; kGlobal: "module.name"; kBigInt: little-endian two's complement bytes.
  std::string s;
  std::vector<PyRef> items;                      // kTuple, kList
  std::vector<std::pair<PyRef, PyRef>> entries;  // kDict, in insertion order
  std::shared_ptr<const StorageRef> storage;     // kStorage
  std::shared_ptr<const TensorRef> tensor;       // kTensor

  PyValue() = default;
  PyValue(const PyValue&) = delete;
  PyValue& operator=(const PyValue&) = delete;
  // Iterative, so that a maliciously deep pickle cannot overflow the stack on destruction.
  ~PyValue();
};

PyRef NewValue(PyValue::Kind kind);
const char* KindName(PyValue::Kind k);

// torch_objects.cc: the meaning of the globals a pickle may name.
// Element size and torch dtype name of a storage class ("torch.FloatStorage") or a dtype
// global ("torch.float32"); false for anything else.
bool LookupDType(const std::string& global, std::string* dtype, size_t* elem_size);
// Whether GLOBAL may name `global` at all (checked before anything else happens with it).
bool AllowedGlobal(const std::string& global);
// REDUCE: `func` (an allowed global) applied to `args`, e.g. a tensor rebuilt from its storage.
absl::StatusOr<PyRef> CallGlobal(const std::string& func, const std::vector<PyRef>& args);
// BUILD: sets the state (the attributes) of `obj`.
absl::Status SetState(PyValue& obj, const PyValue& state);

// Turns a persistent id (the tuple torch.save's persistent_id returned) into a kStorage value.
using PersistentLoad = std::function<absl::StatusOr<PyRef>(const PyValue& pid)>;

// Unpickles one pickle from the start of `data`; `*consumed` is set to its length (STOP
// included). Errors name the opcode or global and its offset in `data`.
absl::StatusOr<PyRef> Unpickle(std::string_view data, const PersistentLoad& persistent_load,
                               size_t* consumed);

}  // namespace tgis::server::torch_detail
