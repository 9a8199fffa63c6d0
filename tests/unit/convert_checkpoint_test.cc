// convert-to-safetensors against transformers: the .bin checkpoints of
// tests/fixtures/bin_checkpoints (make_bin_checkpoint_fixtures.py) must convert to exactly the
// tensors transformers wrote as safetensors for the same models, tied weights stored once.
#include "server/convert_checkpoint.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "server/weights.h"

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;
using tgis::kernels::Tensor;
using tgis::server::ConvertToSafetensors;
using tgis::server::ReadSafetensorsFile;
using tgis::server::SharedNamesToDrop;
using tgis::server::TorchTensor;

fs::path Fixtures() {
  const char* env = std::getenv("TGIS_FIXTURES_DIR");
  return fs::path(env != nullptr && *env != '\0' ? env : TGIS_FIXTURES_DIR);
}

class ConvertTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tmp_ = fs::temp_directory_path() /
           ("tgis_convert_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(tmp_);
    fs::create_directories(tmp_);
  }
  void TearDown() override { fs::remove_all(tmp_); }
  // A writable copy of a fixture folder.
  fs::path Copy(const std::string& name) {
    const fs::path dst = tmp_ / name;
    fs::copy(Fixtures() / "bin_checkpoints" / name, dst, fs::copy_options::recursive);
    return dst;
  }
  fs::path tmp_;
};

std::string Read(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

Json Header(const fs::path& p) {
  const std::string file = Read(p);
  uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  return Json::parse(file.substr(8, n));
}

// Every tensor of `want` is in `got` with the same dtype, shape and bytes, and nothing else is.
void ExpectSameTensors(const std::map<std::string, Tensor>& got,
                       const std::map<std::string, Tensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [name, w] : want) {
    auto it = got.find(name);
    ASSERT_NE(it, got.end()) << name;
    const Tensor& g = it->second;
    EXPECT_EQ(g.dtype(), w.dtype()) << name;
    EXPECT_EQ(g.shape(), w.shape()) << name;
    ASSERT_EQ(g.nbytes(), w.nbytes()) << name;
    EXPECT_EQ(std::memcmp(g.raw(), w.raw(), w.nbytes()), 0) << name;
  }
}

std::map<std::string, Tensor> ReadAll(const std::vector<fs::path>& files) {
  std::map<std::string, Tensor> all;
  for (const fs::path& f : files) {
    auto t = ReadSafetensorsFile(f.string());
    EXPECT_TRUE(t.ok()) << t.status();
    if (t.ok()) all.merge(*t);
  }
  return all;
}

TEST_F(ConvertTest, BinConvertsToTheTensorsTransformersWroteAsSafetensors) {
  const fs::path dir = Copy("llama");
  auto r = ConvertToSafetensors(dir.string());
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->written, std::vector<std::string>{(dir / "model.safetensors").string()});
  ExpectSameTensors(ReadAll({dir / "model.safetensors"}),
                    ReadAll({Fixtures() / "models" / "llama" / "model.safetensors"}));
  EXPECT_EQ(Header(dir / "model.safetensors")["__metadata__"], Json({{"format", "pt"}}));
  // The whole folder now loads as a checkpoint.
  auto store = tgis::server::WeightStore::Open(dir.string());
  ASSERT_TRUE(store.ok()) << store.status();
}

TEST_F(ConvertTest, ShardedBinAndItsIndexConvertFileForFile) {
  const fs::path dir = Copy("llama_shards");
  auto r = ConvertToSafetensors(dir.string());
  ASSERT_TRUE(r.ok()) << r.status();
  const Json index = Json::parse(Read(dir / "model.safetensors.index.json"));
  const Json bin_index = Json::parse(Read(dir / "pytorch_model.bin.index.json"));
  EXPECT_EQ(index["metadata"], bin_index["metadata"]);
  ASSERT_EQ(index["weight_map"].size(), bin_index["weight_map"].size());
  for (const auto& [name, file] : bin_index["weight_map"].items()) {
    const std::string bin = file.get<std::string>();
    // pytorch_model-00001-of-00002.bin -> model-00001-of-00002.safetensors
    EXPECT_EQ(index["weight_map"][name], bin.substr(8, bin.size() - 12) + ".safetensors") << name;
    auto shard = ReadSafetensorsFile((dir / index["weight_map"][name].get<std::string>()).string());
    ASSERT_TRUE(shard.ok()) << shard.status();
    EXPECT_TRUE(shard->count(name)) << name;
  }
  ExpectSameTensors(
      ReadAll({dir / "model-00001-of-00002.safetensors", dir / "model-00002-of-00002.safetensors"}),
      ReadAll({Fixtures() / "models" / "llama" / "model.safetensors"}));
}

TEST_F(ConvertTest, TiedWeightsAreWrittenOnceAsTransformersDoes) {
  const fs::path dir = Copy("tied");
  auto r = ConvertToSafetensors(dir.string());
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectSameTensors(ReadAll({dir / "model.safetensors"}), ReadAll({dir / "reference.safetensors"}));
  EXPECT_EQ(Header(dir / "model.safetensors")["__metadata__"],
            Json({{"format", "pt"}, {"lm_head.weight", "model.embed_tokens.weight"}}));
}

TEST_F(ConvertTest, ExistingSafetensorsAreNotOverwritten) {
  const fs::path dir = Copy("llama");
  std::ofstream(dir / "model.safetensors") << "mine";
  auto r = ConvertToSafetensors(dir.string());
  EXPECT_TRUE(absl::IsAlreadyExists(r.status())) << r.status();
  EXPECT_EQ(Read(dir / "model.safetensors"), "mine");
}

TEST_F(ConvertTest, FolderWithoutBinFilesIsNotFound) {
  auto r = ConvertToSafetensors(tmp_.string());
  EXPECT_TRUE(absl::IsNotFound(r.status())) << r.status();
}

TEST_F(ConvertTest, HostilePickleIsRefusedAndNothingIsWritten) {
  // A pickle naming a global other than torch's rebuild functions (os.system, in the fixture)
  // is refused by name; no safetensors file is left behind.
  fs::copy(Fixtures() / "torch_files" / "bad_global.pt", tmp_ / "pytorch_model.bin");
  auto r = ConvertToSafetensors(tmp_.string());
  ASSERT_FALSE(r.ok());
  const std::string msg(r.status().message());
  EXPECT_NE(msg.find("pytorch_model.bin"), std::string::npos) << msg;
  EXPECT_NE(msg.find("posix.system"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(tmp_ / "model.safetensors"));
  EXPECT_FALSE(fs::exists(tmp_ / "model.safetensors.tmp"));
}

TEST_F(ConvertTest, TrainingLeftoversAreNotConverted) {
  const fs::path dir = Copy("llama");
  fs::copy(dir / "pytorch_model.bin", dir / "training_args.bin");
  auto r = ConvertToSafetensors(dir.string());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(fs::exists(dir / "training_args.safetensors"));
  EXPECT_TRUE(fs::exists(dir / "model.safetensors"));
}

TorchTensor View(const std::string& storage, int64_t storage_nbytes, int64_t first, int64_t end) {
  TorchTensor t;
  t.dtype = "float32";
  t.shape = {(end - first) / 4};
  t.bytes.resize(static_cast<size_t>(end - first));
  t.storage = storage;
  t.storage_nbytes = storage_nbytes;
  t.first_byte = first;
  t.end_byte = end;
  return t;
}

TEST(SharedNamesToDropTest, KeepsTheFirstCompleteNameNotTiedOutput) {
  std::map<std::string, TorchTensor> t = {{"a.weight", View("0", 64, 0, 64)},
                                          {"lm_head.weight", View("0", 64, 0, 64)},
                                          {"z.weight", View("0", 64, 0, 64)}};
  auto drop = SharedNamesToDrop(t, tgis::server::TiedOutputNames());
  ASSERT_TRUE(drop.ok()) << drop.status();
  EXPECT_EQ(*drop, (std::map<std::string, std::string>{{"lm_head.weight", "a.weight"},
                                                       {"z.weight", "a.weight"}}));
}

TEST(SharedNamesToDropTest, DisjointViewsOfOneStorageAreEachKept) {
  // A fused tensor saved only as its parts: nothing overlaps, nothing is shared.
  std::map<std::string, TorchTensor> t = {
      {"q", View("0", 96, 0, 32)}, {"k", View("0", 96, 32, 64)}, {"v", View("0", 96, 64, 96)}};
  auto drop = SharedNamesToDrop(t, {});
  ASSERT_TRUE(drop.ok()) << drop.status();
  EXPECT_TRUE(drop->empty());
}

TEST(SharedNamesToDropTest, OverlappingViewsWithNoWholeStorageAreRefused) {
  std::map<std::string, TorchTensor> t = {{"x", View("0", 96, 0, 64)},
                                          {"y", View("0", 96, 32, 96)}};
  auto drop = SharedNamesToDrop(t, {});
  ASSERT_FALSE(drop.ok());
  EXPECT_NE(drop.status().message().find("x, y"), std::string::npos) << drop.status();
}

}  // namespace
