// ReadTorchFile against files torch.save wrote (tests/fixtures/make_torch_fixtures.py): every
// tensor's dtype, shape and values must be what torch holds, exactly, and every float tensor's
// conversion must match torch's .to(); bad files must fail with a message naming the file.
#include "server/torch_file.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using tgis::kernels::DType;
using tgis::server::ParseTorchFile;
using tgis::server::ReadTorchFile;
using tgis::server::ToFloatTensor;
using tgis::server::TorchTensor;

// TGIS_FIXTURES_DIR from the environment (a bundle run elsewhere), else the source tree's.
fs::path TorchFilesDir() {
  const char* env = std::getenv("TGIS_FIXTURES_DIR");
  return fs::path(env != nullptr && *env != '\0' ? env : TGIS_FIXTURES_DIR) / "torch_files";
}

const Json& Expected() {
  static const Json j = [] {
    std::ifstream in(TorchFilesDir() / "expected.json");
    std::stringstream buf;
    buf << in.rdbuf();
    return Json::parse(buf.str(), nullptr, /*allow_exceptions=*/false);
  }();
  return j;
}

std::vector<std::string> CaseFiles() {
  std::vector<std::string> out;
  if (Expected().is_object()) {
    for (const Json& c : Expected()["cases"]) out.push_back(c["file"].get<std::string>());
  }
  return out;
}

const Json& CaseFor(const std::string& file) {
  for (const Json& c : Expected()["cases"]) {
    if (c["file"] == file) return c;
  }
  static const Json none;
  return none;
}

// Numbers, or "inf" / "-inf" / "nan" where JSON has no number.
std::vector<double> Doubles(const Json& j) {
  std::vector<double> out;
  for (const Json& v : j)
    out.push_back(v.is_string() ? std::stod(v.get<std::string>()) : v.get<double>());
  return out;
}

template <typename T>
double Load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return static_cast<double>(v);
}

// The tensor's values as doubles, decoded independently of ToFloatTensor.
std::vector<double> Values(const TorchTensor& t) {
  struct Decoder {
    const char* dtype;
    size_t size;
    double (*load)(const uint8_t*);
  };
  static const Decoder kDecoders[] = {
      {"float32", 4, Load<float>},
      {"float64", 8, Load<double>},
      {"float16", 2,
       [](const uint8_t* p) { return double{tgis::kernels::F16ToF32(Load<uint16_t>(p))}; }},
      {"bfloat16", 2,
       [](const uint8_t* p) { return double{tgis::kernels::Bf16ToF32(Load<uint16_t>(p))}; }},
      {"int64", 8, Load<int64_t>},
      {"int32", 4, Load<int32_t>},
      {"int16", 2, Load<int16_t>},
      {"int8", 1, Load<int8_t>},
      {"uint8", 1, Load<uint8_t>},
      {"uint16", 2, Load<uint16_t>},
      {"bool", 1, Load<uint8_t>},
  };
  for (const Decoder& d : kDecoders) {
    if (t.dtype != d.dtype) continue;
    std::vector<double> out;
    for (size_t i = 0; i + d.size <= t.bytes.size(); i += d.size) {
      out.push_back(d.load(t.bytes.data() + i));
    }
    return out;
  }
  ADD_FAILURE() << "no decoder for dtype " << t.dtype;
  return {};
}

std::vector<double> Floats(const tgis::kernels::Tensor& t) {
  std::vector<double> out;
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (t.dtype() == DType::kF32) out.push_back(t.data<float>()[i]);
    if (t.dtype() == DType::kBF16) out.push_back(tgis::kernels::Bf16ToF32(t.data<uint16_t>()[i]));
    if (t.dtype() == DType::kF16) out.push_back(tgis::kernels::F16ToF32(t.data<uint16_t>()[i]));
  }
  return out;
}

class TorchFileTest : public ::testing::TestWithParam<std::string> {};

TEST_P(TorchFileTest, MatchesTorch) {
  const Json& c = CaseFor(GetParam());
  const std::string path = (TorchFilesDir() / GetParam()).string();
  auto read = ReadTorchFile(path);
  if (c.contains("errors")) {
    ASSERT_FALSE(read.ok()) << path << " should have been refused";
    const std::string msg(read.status().message());
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    for (const Json& e : c["errors"]) {
      EXPECT_NE(msg.find(e.get<std::string>()), std::string::npos)
          << "'" << e.get<std::string>() << "' not in: " << msg;
    }
    return;
  }
  ASSERT_TRUE(read.ok()) << read.status();
  const auto& want = c["tensors"];
  ASSERT_EQ(read->size(), want.size());
  for (auto it = want.begin(); it != want.end(); ++it) {
    SCOPED_TRACE("key '" + it.key() + "'");
    auto found = read->find(it.key());
    ASSERT_NE(found, read->end());
    const TorchTensor& t = found->second;
    const Json& w = it.value();
    EXPECT_EQ(t.dtype, w["dtype"].get<std::string>());
    EXPECT_EQ(t.shape, w["shape"].get<std::vector<int64_t>>());
    EXPECT_EQ(Values(t), Doubles(w["values"]));
    const std::string what = path + ": " + it.key();
    for (auto [dtype, name] :
         {std::pair{DType::kF32, "as_float32"}, std::pair{DType::kBF16, "as_bfloat16"},
          std::pair{DType::kF16, "as_float16"}}) {
      auto converted = ToFloatTensor(t, dtype, what);
      const bool is_float = t.dtype == "float64" || t.dtype == "float32" || t.dtype == "float16" ||
                            t.dtype == "bfloat16";
      if (!is_float) {
        ASSERT_FALSE(converted.ok());
        EXPECT_NE(converted.status().message().find(what), std::string::npos);
        EXPECT_NE(converted.status().message().find(t.dtype), std::string::npos);
        continue;
      }
      ASSERT_TRUE(converted.ok()) << converted.status();
      EXPECT_EQ(converted->dtype(), dtype);
      const std::vector<int64_t> shape = t.shape.empty() ? std::vector<int64_t>{1} : t.shape;
      EXPECT_EQ(converted->shape(), shape);
      const Json& expect = w.contains(name) ? w[name] : w["values"];
      EXPECT_EQ(Floats(*converted), Doubles(expect)) << name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TorchFileTest, ::testing::ValuesIn(CaseFiles()),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           std::string name = info.param;
                           for (char& ch : name) {
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return name;
                         });

TEST(TorchFile, FixturesArePresent) {
  ASSERT_TRUE(Expected().is_object()) << "cannot read " << TorchFilesDir() / "expected.json";
  EXPECT_GE(CaseFiles().size(), 20u);
}

TEST(TorchFile, MissingFileNamesIt) {
  auto read = ReadTorchFile("/nonexistent/decoder.pt");
  ASSERT_FALSE(read.ok());
  EXPECT_NE(read.status().message().find("/nonexistent/decoder.pt"), std::string::npos);
}

TEST(TorchFile, RefusesNonFloatTargetAndBadSizes) {
  TorchTensor t;
  t.dtype = "float32";
  t.shape = {2};
  t.bytes.assign(8, 0);
  auto to_int = ToFloatTensor(t, DType::kI32, "x.pt: w");
  ASSERT_FALSE(to_int.ok());
  EXPECT_NE(to_int.status().message().find("x.pt: w"), std::string::npos);
  t.bytes.resize(6);
  EXPECT_FALSE(ToFloatTensor(t, DType::kF32).ok());
}

// Found by the torch_file fuzz target (a leak): a pickle that puts a container inside itself
// is refused, and its memory is freed (the ASan build's leak check sees the latter).
TEST(TorchFile, RefusesAContainerThatHoldsItself) {
  // The legacy stream's magic number and protocol version, then its sys_info pickle: PROTO 2,
  // EMPTY_LIST, BINPUT 0, BINGET 0, APPEND, STOP (a list in itself), or the same with a dict
  // set into itself.
  const std::string head(
      "\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19."
      "\x80\x02M\xe9\x03.",
      21);
  for (const std::string& cycle : {std::string("\x80\x02]q\x00"
                                               "h\x00"
                                               "a.",
                                               9),
                                   std::string("\x80\x02}q\x00"
                                               "K\x01"
                                               "h\x00"
                                               "s.",
                                               11)}) {
    auto read = ParseTorchFile(head + cycle, "cycle.pt");
    ASSERT_FALSE(read.ok());
    EXPECT_NE(read.status().message().find(
                  "pickle: a container holds itself (a reference cycle; torch.save never writes "
                  "one)"),
              std::string::npos)
        << read.status().message();
  }
}

}  // namespace
