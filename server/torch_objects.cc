// What the allowlisted globals of a torch.save pickle mean: storage classes and dtypes, the
// tensor rebuild functions, OrderedDict. Interpreted here, never imported or run.
#include "absl/strings/str_cat.h"
#include "server/torch_pickle.h"

namespace tgis::server::torch_detail {
namespace {

using Kind = PyValue::Kind;

struct DTypeInfo {
  const char* storage;  // the typed storage class naming this dtype, if there is one
  const char* dtype;
  size_t size;
};
// clang-format off
constexpr DTypeInfo kDTypes[] = {
    {"FloatStorage", "float32", 4}, {"DoubleStorage", "float64", 8},
    {"HalfStorage", "float16", 2}, {"BFloat16Storage", "bfloat16", 2},
    {"LongStorage", "int64", 8}, {"IntStorage", "int32", 4}, {"ShortStorage", "int16", 2},
    {"CharStorage", "int8", 1}, {"ByteStorage", "uint8", 1}, {"BoolStorage", "bool", 1},
    {"ComplexFloatStorage", "complex64", 8}, {"ComplexDoubleStorage", "complex128", 16},
    // Dtypes without a typed storage class reach files only through _rebuild_tensor_v3.
    {nullptr, "uint16", 2}, {nullptr, "uint32", 4}, {nullptr, "uint64", 8},
    {nullptr, "float8_e4m3fn", 1}, {nullptr, "float8_e5m2", 1}};
// clang-format on

bool GetInt(const PyRef& v, int64_t* out) {
  if (v->kind != Kind::kInt) return false;
  *out = v->i;
  return true;
}

bool GetInts(const PyRef& v, std::vector<int64_t>* out) {
  if (v->kind != Kind::kTuple) return false;
  for (const PyRef& e : v->items) {
    if (e->kind != Kind::kInt || e->i < 0) return false;
    out->push_back(e->i);
  }
  return true;
}

}  // namespace

// The globals a torch.save pickle of tensors and state dicts needs (cf. torch's weights_only
// allowlist); anything else, e.g. a pickled function or class, is refused when named.
bool AllowedGlobal(const std::string& name) {
  static const char* const kAllowed[] = {"collections.OrderedDict",
                                         "torch._utils._rebuild_tensor_v2",
                                         "torch._utils._rebuild_tensor_v3",
                                         "torch._utils._rebuild_parameter",
                                         "torch._utils._rebuild_parameter_with_state",
                                         "torch._tensor._rebuild_from_type_v2",
                                         "torch.Tensor",
                                         "torch.nn.parameter.Parameter",
                                         "torch.Size"};
  for (const char* a : kAllowed) {
    if (name == a) return true;
  }
  std::string dtype;
  size_t size;
  return LookupDType(name, &dtype, &size);
}

bool LookupDType(const std::string& global, std::string* dtype, size_t* elem_size) {
  std::string_view name = global;
  for (std::string_view prefix : {"torch.cuda.", "torch.storage.", "torch."}) {
    if (name.substr(0, prefix.size()) == prefix) {
      name.remove_prefix(prefix.size());
      break;
    }
  }
  if (name.size() == global.size()) return false;
  if (name == "UntypedStorage") {  // bytes; a tensor over it names its own dtype (v3)
    *dtype = "uint8";
    *elem_size = 1;
    return true;
  }
  for (const DTypeInfo& t : kDTypes) {
    if ((t.storage != nullptr && name == t.storage) || name == t.dtype) {
      *dtype = t.dtype;
      *elem_size = t.size;
      return true;
    }
  }
  return false;
}

absl::StatusOr<PyRef> CallGlobal(const std::string& func, const std::vector<PyRef>& args) {
  const size_t n = args.size();
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(func, ": ", what));
  };
  if (func == "collections.OrderedDict") {
    if (n != 0) return bad("expected no arguments");
    return NewValue(Kind::kDict);
  }
  if (func == "torch.Size") {
    std::vector<int64_t> dims;
    if (n != 1 || !GetInts(args[0], &dims)) return bad("expected a tuple of sizes");
    return args[0];
  }
  if (func == "torch._utils._rebuild_tensor_v2" || func == "torch._utils._rebuild_tensor_v3") {
    const bool v3 = func.back() == '3';
    const size_t want = v3 ? 7 : 6;
    if (n != want && n != want + 1) return bad(absl::StrCat("expected ", want, " arguments"));
    if (args[0]->kind != Kind::kStorage) return bad("argument 0 is not a storage");
    auto t = std::make_shared<TensorRef>();
    t->storage = *args[0]->storage;
    t->dtype = t->storage.dtype;
    t->elem_size = t->storage.elem_size;
    if (v3 &&
        (args[6]->kind != Kind::kGlobal || !LookupDType(args[6]->s, &t->dtype, &t->elem_size))) {
      return bad("argument 6 is not a known dtype");
    }
    if (!GetInt(args[1], &t->offset) || t->offset < 0) return bad("bad storage offset");
    if (!GetInts(args[2], &t->size) || !GetInts(args[3], &t->stride) ||
        t->size.size() != t->stride.size()) {
      return bad("bad size or stride");
    }
    // torch writes the metadata argument only when the tensor has some (torch._utils.
    // get_tensor_metadata); we do not know what it would change, so such tensors are refused.
    if (n == want + 1 && !(args[n - 1]->kind == Kind::kNone ||
                           (args[n - 1]->kind == Kind::kDict && args[n - 1]->entries.empty()))) {
      return bad("tensor metadata is not supported");
    }
    PyRef v = NewValue(Kind::kTensor);
    v->tensor = std::move(t);
    return v;
  }
  // A Parameter is its data; requires_grad, hooks and Python attributes (state) are training
  // bookkeeping, not weights.
  if (func == "torch._utils._rebuild_parameter" ||
      func == "torch._utils._rebuild_parameter_with_state") {
    if (n < 3 || args[0]->kind != Kind::kTensor) return bad("argument 0 is not a tensor");
    return args[0];
  }
  if (func == "torch._tensor._rebuild_from_type_v2") {
    if (n != 4 || args[0]->kind != Kind::kGlobal || args[2]->kind != Kind::kTuple) {
      return bad("expected (function, type, args, state)");
    }
    if (args[0]->s == func) return bad("nested in itself");
    if (args[1]->kind != Kind::kGlobal ||
        (args[1]->s != "torch.Tensor" && args[1]->s != "torch.nn.parameter.Parameter")) {
      return bad("only Tensor and Parameter are supported, not tensor subclasses");
    }
    return CallGlobal(args[0]->s, args[2]->items);
  }
  return bad("cannot be called here");
}

absl::Status SetState(PyValue& obj, const PyValue& state) {
  // A state dict carries its module versions in a `_metadata` attribute; that is the only
  // attribute we accept, and it is dropped (it names no tensor).
  if (obj.kind == Kind::kDict && state.kind == Kind::kDict) {
    for (const auto& [k, v] : state.entries) {
      if (k->kind != Kind::kStr || k->s != "_metadata") {
        return absl::InvalidArgumentError(absl::StrCat(
            "attribute '", k->kind == Kind::kStr ? k->s : "?", "' of a dict is not supported"));
      }
    }
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("cannot set the state of a ", KindName(obj.kind)));
}

}  // namespace tgis::server::torch_detail
