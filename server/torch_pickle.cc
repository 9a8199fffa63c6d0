#include "server/torch_pickle.h"

#include <cstring>
#include <memory>
#include <unordered_map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tgis::server::torch_detail {
namespace {

using Kind = PyValue::Kind;

// clang-format off
// Names for error messages; opcodes missing here are reported by their byte alone.
constexpr std::pair<uint8_t, const char*> kOpNames[] = {
    {'(', "MARK"}, {'.', "STOP"}, {'0', "POP"}, {'1', "POP_MARK"}, {'2', "DUP"},
    {'F', "FLOAT"}, {'I', "INT"}, {'J', "BININT"}, {'K', "BININT1"}, {'L', "LONG"},
    {'M', "BININT2"}, {'N', "NONE"}, {'P', "PERSID"}, {'Q', "BINPERSID"}, {'R', "REDUCE"},
    {'S', "STRING"}, {'T', "BINSTRING"}, {'U', "SHORT_BINSTRING"}, {'V', "UNICODE"},
    {'X', "BINUNICODE"}, {'a', "APPEND"}, {'b', "BUILD"}, {'c', "GLOBAL"}, {'d', "DICT"},
    {'}', "EMPTY_DICT"}, {'e', "APPENDS"}, {'g', "GET"}, {'h', "BINGET"}, {'i', "INST"},
    {'j', "LONG_BINGET"}, {'l', "LIST"}, {']', "EMPTY_LIST"}, {'o', "OBJ"}, {'p', "PUT"},
    {'q', "BINPUT"}, {'r', "LONG_BINPUT"}, {'s', "SETITEM"}, {'t', "TUPLE"},
    {')', "EMPTY_TUPLE"}, {'u', "SETITEMS"}, {'G', "BINFLOAT"}, {'B', "BINBYTES"},
    {'C', "SHORT_BINBYTES"}, {0x80, "PROTO"}, {0x81, "NEWOBJ"}, {0x82, "EXT1"}, {0x83, "EXT2"},
    {0x84, "EXT4"}, {0x85, "TUPLE1"}, {0x86, "TUPLE2"}, {0x87, "TUPLE3"}, {0x88, "NEWTRUE"},
    {0x89, "NEWFALSE"}, {0x8a, "LONG1"}, {0x8b, "LONG4"}, {0x8c, "SHORT_BINUNICODE"},
    {0x8d, "BINUNICODE8"}, {0x8e, "BINBYTES8"}, {0x8f, "EMPTY_SET"}, {0x90, "ADDITEMS"},
    {0x91, "FROZENSET"}, {0x92, "NEWOBJ_EX"}, {0x93, "STACK_GLOBAL"}, {0x94, "MEMOIZE"},
    {0x95, "FRAME"}, {0x96, "BYTEARRAY8"}, {0x97, "NEXT_BUFFER"}, {0x98, "READONLY_BUFFER"}};
// clang-format on

std::string OpName(uint8_t op) {
  for (const auto& [code, name] : kOpNames) {
    if (code == op) return absl::StrFormat("%s (0x%02x)", name, op);
  }
  return absl::StrFormat("0x%02x", op);
}

class Machine {
 public:
  Machine(std::string_view data, const PersistentLoad& pl) : d_(data), persistent_load_(pl) {}
  absl::StatusOr<PyRef> Run(size_t* consumed);

 private:
  absl::Status Err(absl::string_view msg) const {
    return absl::InvalidArgumentError(
        absl::StrCat("pickle: ", OpName(op_), " at offset ", op_pos_, ": ", msg));
  }
  bool Take(size_t n, const char** p) {
    if (n > d_.size() - pos_) return false;
    *p = d_.data() + pos_;
    pos_ += n;
    return true;
  }
  bool TakeLE(size_t n, uint64_t* v) {
    const char* p;
    if (!Take(n, &p)) return false;
    *v = 0;
    for (size_t k = 0; k < n; ++k) *v |= uint64_t{static_cast<uint8_t>(p[k])} << (8 * k);
    return true;
  }
  bool TakeLine(std::string* s) {
    const size_t end = d_.find('\n', pos_);
    if (end == std::string_view::npos) return false;
    *s = std::string(d_.substr(pos_, end - pos_));
    pos_ = end + 1;
    return true;
  }
  bool Pop(PyRef* v) {
    if (stack_.empty() || (!marks_.empty() && marks_.back() == stack_.size())) return false;
    *v = std::move(stack_.back());
    stack_.pop_back();
    return true;
  }
  bool PopMark(std::vector<PyRef>* items) {
    if (marks_.empty()) return false;
    items->assign(std::make_move_iterator(stack_.begin() + marks_.back()),
                  std::make_move_iterator(stack_.end()));
    stack_.resize(marks_.back());
    marks_.pop_back();
    return true;
  }
  absl::Status Step(bool* done);
  absl::Status PushSized(Kind kind, size_t len_bytes);
  absl::Status PushLong(size_t len_bytes);

  std::string_view d_;
  const PersistentLoad& persistent_load_;
  size_t pos_ = 0;
  size_t op_pos_ = 0;
  uint8_t op_ = 0;
  std::vector<PyRef> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, PyRef> memo_;
};

absl::StatusOr<PyRef> Machine::Run(size_t* consumed) {
  for (bool done = false; !done;) {
    op_pos_ = pos_;
    const char* p;
    if (!Take(1, &p)) {
      op_ = 0;
      return absl::InvalidArgumentError(
          absl::StrCat("pickle: ends at offset ", pos_, " before its STOP opcode (truncated?)"));
    }
    op_ = static_cast<uint8_t>(*p);
    if (absl::Status st = Step(&done); !st.ok()) return st;
  }
  *consumed = pos_;
  return stack_.back();
}

absl::Status Machine::PushSized(Kind kind, size_t len_bytes) {
  uint64_t n;
  const char* p;
  if (!TakeLE(len_bytes, &n) || !Take(n, &p)) return Err("truncated");
  PyRef v = NewValue(kind);
  v->s.assign(p, n);
  stack_.push_back(std::move(v));
  return absl::OkStatus();
}

absl::Status Machine::PushLong(size_t len_bytes) {
  uint64_t n;
  const char* p;
  if (!TakeLE(len_bytes, &n) || !Take(n, &p)) return Err("truncated");
  if (n > 8) {  // only the legacy format's magic number is this big
    PyRef v = NewValue(Kind::kBigInt);
    v->s.assign(p, n);
    stack_.push_back(std::move(v));
    return absl::OkStatus();
  }
  uint64_t u = 0;
  for (size_t k = 0; k < n; ++k) u |= uint64_t{static_cast<uint8_t>(p[k])} << (8 * k);
  if (n > 0 && n < 8 && (static_cast<uint8_t>(p[n - 1]) & 0x80)) u |= ~uint64_t{0} << (8 * n);
  PyRef v = NewValue(Kind::kInt);
  v->i = static_cast<int64_t>(u);
  stack_.push_back(std::move(v));
  return absl::OkStatus();
}

absl::Status Machine::Step(bool* done) {
  PyRef a, b;
  std::vector<PyRef> items;
  uint64_t u;
  auto push_int = [&](int64_t i) {
    PyRef v = NewValue(Kind::kInt);
    v->i = i;
    stack_.push_back(std::move(v));
    return absl::OkStatus();
  };
  auto push_seq = [&](Kind kind, std::vector<PyRef> elems) {
    PyRef v = NewValue(kind);
    v->items = std::move(elems);
    stack_.push_back(std::move(v));
    return absl::OkStatus();
  };
  auto underflow = [this] { return Err("stack underflow (corrupt pickle)"); };
  switch (op_) {
    case 0x80:  // PROTO
      if (!TakeLE(1, &u)) return Err("truncated");
      if (u > 5) return Err(absl::StrCat("unknown pickle protocol ", u));
      return absl::OkStatus();
    case 0x95:  // FRAME: only a read-ahead hint
      return TakeLE(8, &u) ? absl::OkStatus() : Err("truncated");
    case '.':  // STOP
      if (!Pop(&a)) return underflow();
      stack_.push_back(std::move(a));
      *done = true;
      return absl::OkStatus();
    case '(':
      marks_.push_back(stack_.size());
      return absl::OkStatus();
    case '0':
      if (!marks_.empty() && marks_.back() == stack_.size()) {
        marks_.pop_back();
        return absl::OkStatus();
      }
      return Pop(&a) ? absl::OkStatus() : underflow();
    case '1':
      return PopMark(&items) ? absl::OkStatus() : underflow();
    case '2':
      if (!Pop(&a)) return underflow();
      stack_.push_back(a);
      stack_.push_back(a);
      return absl::OkStatus();
    case 'N':
      stack_.push_back(NewValue(Kind::kNone));
      return absl::OkStatus();
    case 0x88:
    case 0x89:
      a = NewValue(Kind::kBool);
      a->i = op_ == 0x88;
      stack_.push_back(std::move(a));
      return absl::OkStatus();
    case 'J':
      if (!TakeLE(4, &u)) return Err("truncated");
      return push_int(static_cast<int32_t>(static_cast<uint32_t>(u)));
    case 'K':
    case 'M':
      if (!TakeLE(op_ == 'K' ? 1 : 2, &u)) return Err("truncated");
      return push_int(static_cast<int64_t>(u));
    case 0x8a:
      return PushLong(1);
    case 0x8b:
      return PushLong(4);
    case 'G': {
      if (!TakeLE(8, &u)) return Err("truncated");
      u = __builtin_bswap64(u);  // big-endian on the wire
      a = NewValue(Kind::kFloat);
      std::memcpy(&a->f, &u, 8);
      stack_.push_back(std::move(a));
      return absl::OkStatus();
    }
    case 'X':
      return PushSized(Kind::kStr, 4);
    case 0x8c:
    case 'U':
      return PushSized(Kind::kStr, 1);
    case 0x8d:
      return PushSized(Kind::kStr, 8);
    case 'T':
      return PushSized(Kind::kStr, 4);
    case 'C':
      return PushSized(Kind::kBytes, 1);
    case 'B':
      return PushSized(Kind::kBytes, 4);
    case 0x8e:
      return PushSized(Kind::kBytes, 8);
    case ')':
      return push_seq(Kind::kTuple, {});
    case ']':
      return push_seq(Kind::kList, {});
    case '}':
      stack_.push_back(NewValue(Kind::kDict));
      return absl::OkStatus();
    case 't':
    case 'l':
      if (!PopMark(&items)) return underflow();
      return push_seq(op_ == 't' ? Kind::kTuple : Kind::kList, std::move(items));
    case 0x85:
    case 0x86:
    case 0x87: {
      const size_t n = op_ - 0x84;
      if (stack_.size() < n + (marks_.empty() ? 0 : marks_.back())) return underflow();
      items.assign(stack_.end() - n, stack_.end());
      stack_.resize(stack_.size() - n);
      return push_seq(Kind::kTuple, std::move(items));
    }
    case 'a':
    case 'e':
      if (op_ == 'a') {
        if (!Pop(&a)) return underflow();
        items.push_back(std::move(a));
      } else if (!PopMark(&items)) {
        return underflow();
      }
      if (stack_.empty() || stack_.back()->kind != Kind::kList) return Err("target is not a list");
      for (PyRef& e : items) stack_.back()->items.push_back(std::move(e));
      return absl::OkStatus();
    case 'd':
    case 's':
    case 'u':
      if (op_ == 's') {
        if (!Pop(&b) || !Pop(&a)) return underflow();
        items = {a, b};
      } else if (!PopMark(&items)) {
        return underflow();
      }
      if (op_ == 'd') stack_.push_back(NewValue(Kind::kDict));
      if (items.size() % 2 != 0) return Err("odd number of items for a dict");
      if (stack_.empty() || stack_.back()->kind != Kind::kDict) return Err("target is not a dict");
      for (size_t k = 0; k < items.size(); k += 2) {
        stack_.back()->entries.emplace_back(std::move(items[k]), std::move(items[k + 1]));
      }
      return absl::OkStatus();
    case 'q':
    case 'r':
    case 0x94:
      if (op_ == 0x94) {
        u = memo_.size();
      } else if (!TakeLE(op_ == 'q' ? 1 : 4, &u)) {
        return Err("truncated");
      }
      if (stack_.empty()) return underflow();
      memo_[u] = stack_.back();
      return absl::OkStatus();
    case 'h':
    case 'j': {
      if (!TakeLE(op_ == 'h' ? 1 : 4, &u)) return Err("truncated");
      auto it = memo_.find(u);
      if (it == memo_.end()) return Err(absl::StrCat("memo key ", u, " was never stored"));
      stack_.push_back(it->second);
      return absl::OkStatus();
    }
    case 'c':
    case 0x93: {
      std::string module, name;
      if (op_ == 'c') {
        if (!TakeLine(&module) || !TakeLine(&name)) return Err("truncated");
      } else {
        if (!Pop(&b) || !Pop(&a)) return underflow();
        if (a->kind != Kind::kStr || b->kind != Kind::kStr) return Err("names are not strings");
        module = a->s;
        name = b->s;
      }
      a = NewValue(Kind::kGlobal);
      a->s = absl::StrCat(module, ".", name);
      if (!AllowedGlobal(a->s)) {
        return Err(absl::StrCat("global '", a->s,
                                "' is not allowed (only tensors, storages and dicts of them are "
                                "read; nothing in the file is executed)"));
      }
      stack_.push_back(std::move(a));
      return absl::OkStatus();
    }
    case 'R': {
      if (!Pop(&b) || !Pop(&a)) return underflow();
      if (a->kind != Kind::kGlobal || b->kind != Kind::kTuple) {
        return Err(absl::StrCat("calls a ", KindName(a->kind), " with a ", KindName(b->kind)));
      }
      auto r = CallGlobal(a->s, b->items);
      if (!r.ok()) return Err(r.status().message());
      stack_.push_back(*std::move(r));
      return absl::OkStatus();
    }
    case 'b':
      if (!Pop(&b) || stack_.empty()) return underflow();
      if (absl::Status st = SetState(*stack_.back(), *b); !st.ok()) return Err(st.message());
      return absl::OkStatus();
    case 'Q': {
      if (!Pop(&a)) return underflow();
      auto r = persistent_load_(*a);
      if (!r.ok()) return Err(r.status().message());
      stack_.push_back(*std::move(r));
      return absl::OkStatus();
    }
    default:
      return Err("opcode not supported (torch.save does not write it for tensors and dicts)");
  }
}

// Every value made while a pickle is read on this thread (see Unpickle).
thread_local std::vector<std::weak_ptr<PyValue>>* t_made = nullptr;

// The children of a value, in order: items, then each entry's key and value.
size_t ChildCount(const PyValue& v) { return v.items.size() + 2 * v.entries.size(); }
const PyValue* Child(const PyValue& v, size_t i) {
  if (i < v.items.size()) return v.items[i].get();
  const auto& e = v.entries[(i - v.items.size()) / 2];
  return ((i - v.items.size()) % 2 == 0 ? e.first : e.second).get();
}

// Whether any of `made` lies on a reference cycle (iterative depth-first search).
bool HasCycle(const std::vector<std::weak_ptr<PyValue>>& made) {
  enum : uint8_t { kUnseen, kOnPath, kDone };
  std::unordered_map<const PyValue*, uint8_t> state;
  for (const auto& w : made) {
    const PyRef start = w.lock();
    if (start == nullptr || state[start.get()] != kUnseen) continue;
    std::vector<std::pair<const PyValue*, size_t>> path = {{start.get(), 0}};
    state[start.get()] = kOnPath;
    while (!path.empty()) {
      const PyValue* v = path.back().first;
      const size_t i = path.back().second++;
      if (i == ChildCount(*v)) {
        state[v] = kDone;
        path.pop_back();
        continue;
      }
      const PyValue* child = Child(*v, i);
      if (child == nullptr) continue;
      uint8_t& s = state[child];
      if (s == kOnPath) return true;
      if (s == kUnseen) {
        s = kOnPath;
        path.emplace_back(child, 0);
      }
    }
  }
  return false;
}

}  // namespace

PyRef NewValue(PyValue::Kind kind) {
  auto v = std::make_shared<PyValue>();
  v->kind = kind;
  if (t_made != nullptr) t_made->push_back(v);
  return v;
}

const char* KindName(PyValue::Kind k) {
  static const char* const kNames[] = {"None",   "bool",    "int",   "int",  "float",
                                       "str",    "bytes",   "tuple", "list", "dict",
                                       "global", "storage", "tensor"};
  return kNames[static_cast<int>(k)];
}

PyValue::~PyValue() {
  std::vector<PyRef> work;
  auto take = [&work](PyValue& v) {
    for (PyRef& c : v.items) work.push_back(std::move(c));
    for (auto& [k, c] : v.entries) {
      work.push_back(std::move(k));
      work.push_back(std::move(c));
    }
    v.items.clear();
    v.entries.clear();
  };
  take(*this);
  while (!work.empty()) {
    PyRef r = std::move(work.back());
    work.pop_back();
    if (r.use_count() == 1) take(*r);  // r now dies without children to recurse into
  }
}

absl::StatusOr<PyRef> Unpickle(std::string_view data, const PersistentLoad& persistent_load,
                               size_t* consumed) {
  // A hostile pickle can put a list or dict inside itself (DUP or GET, then APPEND or
  // SETITEM), which reference counting never frees. torch.save never writes one: such a
  // pickle is refused, and its cycles are broken (every value made is emptied) so that its
  // memory goes back.
  std::vector<std::weak_ptr<PyValue>> made;
  t_made = &made;
  absl::StatusOr<PyRef> result;
  {
    Machine m(data, persistent_load);
    result = m.Run(consumed);
  }
  t_made = nullptr;
  if (result.ok() && HasCycle(made)) {
    result = absl::InvalidArgumentError(
        "pickle: a container holds itself (a reference cycle; torch.save never writes one)");
  }
  if (!result.ok()) {
    for (const auto& w : made) {
      if (PyRef v = w.lock()) {
        v->items.clear();
        v->entries.clear();
      }
    }
  }
  return result;
}

}  // namespace tgis::server::torch_detail
