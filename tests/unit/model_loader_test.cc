// The loader's strictness: a checkpoint tensor the architecture does not read fails the load
// (unless the architecture lists it as deliberately ignored), a missing one is named, and a
// config the architecture cannot serve names the key and the value.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "server/model_config.h"
#include "server/model_registry.h"
#include "server/quantization.h"
#include "server/weights.h"

namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

std::string ReadAll(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

// A safetensors file of `header` and `data`, the header padded with spaces to a multiple of 8
// bytes as safetensors writes it (so the tensors stay aligned), then `misalign` more spaces,
// which move every tensor off its alignment (a writer other than safetensors' own may do that).
void WriteSafetensors(const fs::path& path, const Json& header, const std::string& data,
                      size_t misalign = 0) {
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8 + misalign, ' ');
  const uint64_t n = h.size();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << h << data;
}

// Every data offset at or past `from` moved by `delta`: the tensors after bytes that were
// removed or grew (safetensors leaves no holes).
void ShiftOffsetsFrom(Json* header, uint64_t from, int64_t delta) {
  for (auto& [name, t] : header->items()) {
    if (name == "__metadata__") continue;
    for (int j : {0, 1}) {
      const auto at = t["data_offsets"][j].get<uint64_t>();
      if (at >= from)
        t["data_offsets"][j] = static_cast<uint64_t>(static_cast<int64_t>(at) + delta);
    }
  }
}

// A copy of the llama fixture in a fresh folder whose model.safetensors and config.json the
// test may rewrite.
class LoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/tgis-loader-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    const fs::path src = fs::path(TGIS_FIXTURES_DIR) / "models" / "llama";
    for (const char* f : {"config.json", "model.safetensors"}) fs::copy(src / f, dir_ / f);
    const std::string bytes = ReadAll(dir_ / "model.safetensors");
    uint64_t n;
    std::memcpy(&n, bytes.data(), 8);
    header_ = Json::parse(bytes.substr(8, n));
    data_ = bytes.substr(8 + n);
  }
  void TearDown() override { fs::remove_all(dir_); }

  void AddTensor(const std::string& name, int64_t numel) {
    const uint64_t begin = data_.size();
    data_.append(static_cast<size_t>(numel) * 4, '\0');
    header_[name] = {{"dtype", "F32"}, {"shape", {numel}}, {"data_offsets", {begin, data_.size()}}};
  }
  // The tensor gone from the header and its bytes from the data.
  void Drop(const std::string& name) {
    const auto begin = header_[name]["data_offsets"][0].get<uint64_t>();
    const auto end = header_[name]["data_offsets"][1].get<uint64_t>();
    header_.erase(name);
    data_.erase(begin, end - begin);
    ShiftOffsetsFrom(&header_, end, -static_cast<int64_t>(end - begin));
  }
  void Save(size_t misalign = 0) {
    WriteSafetensors(dir_ / "model.safetensors", header_, data_, misalign);
  }
  absl::Status Build() {
    auto config = tgis::server::ModelConfig::Load(dir_.string());
    if (!config.ok()) return config.status();
    auto weights = tgis::server::WeightStore::Open(dir_.string());
    if (!weights.ok()) return weights.status();
    return tgis::server::ModelRegistry::Get()
        .Build(*config, **weights, tgis::kernels::DType::kF32)
        .status();
  }
  // The quantized fixture `name`'s config and weights in place of llama's; its
  // quantization_config.
  Json UseFixture(const std::string& name) {
    const fs::path src = fs::path(TGIS_FIXTURES_DIR) / "models" / name;
    for (const char* f : {"config.json", "model.safetensors"}) {
      fs::copy(src / f, dir_ / f, fs::copy_options::overwrite_existing);
    }
    return Json::parse(ReadAll(src / "config.json"))["quantization_config"];
  }
  // The folder's quantization config against `flag` (--quantize).
  absl::Status ReadQuant(std::optional<std::string> flag) {
    auto config = tgis::server::ModelConfig::Load(dir_.string());
    if (!config.ok()) return config.status();
    return tgis::server::ReadQuantConfig(dir_.string(), *config, flag).status();
  }
  // The model built as the shard builds it: the folder's own quantization config applied
  // (`flag`: --quantize).
  absl::Status BuildQuantized(std::optional<std::string> flag = std::nullopt) {
    auto config = tgis::server::ModelConfig::Load(dir_.string());
    if (!config.ok()) return config.status();
    auto q = tgis::server::ReadQuantConfig(dir_.string(), *config, flag);
    if (!q.ok()) return q.status();
    auto weights = tgis::server::WeightStore::Open(dir_.string());
    if (!weights.ok()) return weights.status();
    (*weights)->set_quantization(*q);
    return tgis::server::ModelRegistry::Get()
        .Build(*config, **weights, tgis::kernels::DType::kF32)
        .status();
  }
  static void ExpectError(const absl::Status& st, const std::string& text) {
    EXPECT_FALSE(st.ok()) << text;
    EXPECT_NE(st.message().find(text), std::string::npos) << st;
  }
  // config.json with `base` as its quantization_config, then edited by `edit`.
  void WithQuantConfig(const Json& base, const std::function<void(Json&)>& edit) {
    EditConfig([&](Json& c) {
      c["quantization_config"] = base;
      edit(c["quantization_config"]);
    });
  }
  // config.json as `original` (read in its file's order) with its quantization_config edited
  // by `edit`, key order kept (the order of GPTQModel's and AutoRound's rules decides).
  void WithOrderedQuantConfig(const nlohmann::ordered_json& original,
                              const std::function<void(nlohmann::ordered_json&)>& edit) {
    nlohmann::ordered_json c = original;
    edit(c["quantization_config"]);
    std::ofstream(dir_ / "config.json", std::ios::trunc) << c.dump(1);
  }
  void EditConfig(const std::function<void(Json&)>& edit) {
    Json c = Json::parse(ReadAll(dir_ / "config.json"));
    edit(c);
    std::ofstream(dir_ / "config.json", std::ios::trunc) << c.dump(1);
  }

  fs::path dir_;
  Json header_;
  std::string data_;
};

TEST_F(LoaderTest, TheFixtureLoads) { EXPECT_TRUE(Build().ok()) << Build(); }

// The ASan fuzz run found that a tensor at an odd byte was read as 2- and 4-byte elements in
// place. Such a file loads, its tensors hold the file's bytes, and each starts aligned.
TEST_F(LoaderTest, TensorsAtUnalignedOffsetsLoadFromAlignedCopies) {
  Save(/*misalign=*/1);
  auto w = tgis::server::WeightStore::Open(dir_.string());
  ASSERT_TRUE(w.ok()) << w.status();
  for (auto it = header_.begin(); it != header_.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    auto t = (*w)->View(it.key());
    ASSERT_TRUE(t.ok()) << t.status();
    const auto begin = it.value()["data_offsets"][0].get<size_t>();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t->raw()) % tgis::kernels::DTypeSize(t->dtype()), 0u)
        << it.key();
    ASSERT_EQ(std::memcmp(t->raw(), data_.data() + begin, t->nbytes()), 0) << it.key();
  }
  EXPECT_TRUE(Build().ok()) << Build();
}

TEST_F(LoaderTest, AnUnreadTensorFailsTheLoadNamingItAndItsFile) {
  AddTensor("model.layers.0.self_attn.q_norm.weight", 16);
  Save();
  const absl::Status st = Build();
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("model.layers.0.self_attn.q_norm.weight"), std::string::npos) << st;
  EXPECT_NE(st.message().find("model.safetensors"), std::string::npos) << st;
  EXPECT_NE(st.message().find("'llama'"), std::string::npos) << st;
}

TEST_F(LoaderTest, BiasesTheConfigDoesNotAnnounceAreNotDropped) {
  // attention_bias false but the checkpoint has o_proj biases: transformers would warn and
  // drop them; a server must not answer with another model than the checkpoint's.
  AddTensor("model.layers.0.self_attn.o_proj.bias", 64);
  AddTensor("model.layers.1.self_attn.o_proj.bias", 64);
  Save();
  const absl::Status st = Build();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("2 tensor(s)"), std::string::npos) << st;
  EXPECT_NE(st.message().find("model.layers.1.self_attn.o_proj.bias"), std::string::npos) << st;
}

TEST_F(LoaderTest, ListedBuffersAreIgnored) {
  AddTensor("model.layers.0.self_attn.rotary_emb.inv_freq", 8);
  AddTensor("model.layers.1.self_attn.rotary_emb.inv_freq", 8);
  Save();
  EXPECT_TRUE(Build().ok()) << Build();
}

TEST_F(LoaderTest, AMissingTensorIsNamed) {
  Drop("model.layers.1.mlp.down_proj.weight");
  Save();
  const absl::Status st = Build();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("model.layers.1.mlp.down_proj.weight"), std::string::npos) << st;
}

TEST_F(LoaderTest, AnnouncedBiasesMustBeThere) {
  EditConfig([](Json& c) { c["mlp_bias"] = true; });
  const absl::Status st = Build();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("mlp.gate_proj.bias"), std::string::npos) << st;
}

// Quantization configs: what the server cannot honour is an error naming the file and key.
TEST_F(LoaderTest, QuantizationConfigsAreCheckedAgainstTheFlag) {
  auto read = [&](std::optional<std::string> flag) {
    auto config = tgis::server::ModelConfig::Load(dir_.string());
    EXPECT_TRUE(config.ok()) << config.status();
    return tgis::server::ReadQuantConfig(dir_.string(), *config, flag).status();
  };
  auto expect_error = [&](std::optional<std::string> flag, const std::string& text) {
    const absl::Status st = read(flag);
    EXPECT_FALSE(st.ok()) << text;
    EXPECT_NE(st.message().find(text), std::string::npos) << st;
  };
  EXPECT_TRUE(read(std::nullopt).ok());
  EXPECT_TRUE(read("bitsandbytes").ok());
  expect_error("gptq", "has no quantization config");
  expect_error("nf4",
               "--quantize 'nf4': expected one of gptq, bitsandbytes, bitsandbytes-nf4, "
               "bitsandbytes-fp4, awq, fp8, compressed-tensors, auto-round, mxfp4");
  const Json gptq = {{"quant_method", "gptq"},
                     {"bits", 4},
                     {"group_size", 128},
                     {"desc_act", false},
                     {"sym", true}};
  EditConfig([&](Json& c) { c["quantization_config"] = gptq; });
  EXPECT_TRUE(read(std::nullopt).ok());
  EXPECT_TRUE(read("gptq").ok());
  expect_error("bitsandbytes", "already quantized");
  expect_error("awq", "is quantized otherwise");
  expect_error("auto-round", "is quantized otherwise");  // a GPTQ checkpoint of another tool
  EditConfig([&](Json& c) { c["quantization_config"]["bits"] = 3; });
  expect_error(std::nullopt, "quantization_config: bits = 3");
  EditConfig([&](Json& c) {
    c["quantization_config"] = gptq;
    c["quantization_config"]["act_scale"] = 2;
  });
  expect_error(std::nullopt, "key 'act_scale' is not understood");
  EditConfig([&](Json& c) { c["quantization_config"] = {{"quant_method", "hqq"}}; });
  expect_error(std::nullopt, "quant_method 'hqq' is not supported");
  EditConfig([&](Json& c) { c["quantization_config"] = {{"quant_method", 8}}; });
  expect_error(std::nullopt, "quant_method = 8: expected a string");
  EditConfig([&](Json& c) { c.erase("quantization_config"); });
  std::ofstream(dir_ / "quantize_config.json") << R"({"quant_method": "hqq", "bits": 8})";
  expect_error(std::nullopt, "quantize_config.json: quant_method 'hqq' is not supported");
}

// GPTQModel's "lm_head": true: the head is read quantized (llama_gptq8 stores it so; its parity
// tests check the values), and the config and the tensors must agree.
TEST_F(LoaderTest, AQuantizedLmHeadMustAgreeWithTheGptqConfig) {
  UseFixture("llama_gptq8");
  const fs::path src = fs::path(TGIS_FIXTURES_DIR) / "models" / "llama_gptq8";
  const Json quantize_config = Json::parse(ReadAll(src / "quantize_config.json"));
  auto write_quantize_config = [&](const Json& j) {
    std::ofstream(dir_ / "quantize_config.json", std::ios::trunc) << j.dump(1);
  };
  write_quantize_config(quantize_config);
  EXPECT_TRUE(BuildQuantized().ok()) << BuildQuantized();
  Json edited = quantize_config;
  edited["lm_head"] = false;
  write_quantize_config(edited);
  ExpectError(BuildQuantized(), "lm_head = false, but lm_head.weight is stored quantized");
  edited.erase("lm_head");  // AutoGPTQ's configs never quantize the head
  write_quantize_config(edited);
  ExpectError(BuildQuantized(), "lm_head = false, but lm_head.weight is stored quantized");
  write_quantize_config(quantize_config);
  EditConfig([](Json& c) { c["tie_word_embeddings"] = true; });
  ExpectError(BuildQuantized(), "lm_head = true, but the lm_head is tied to the embedding");

  fs::remove(dir_ / "quantize_config.json");
  const Json gptq4 = UseFixture("llama_gptq4");  // its head is dense
  WithQuantConfig(gptq4, [](Json& q) { q["lm_head"] = true; });
  ExpectError(BuildQuantized(), "lm_head = true, but lm_head.weight is stored dense");
  WithQuantConfig(gptq4, [](Json& q) { q["lm_head"] = "yes"; });
  ExpectError(BuildQuantized(), "lm_head = \"yes\": expected true or false");
}

// GPTQModel's `dynamic` rules (llama_gptq_dynamic: its parity tests check the values): the
// first rule in the file's order that matches a module's name from its start decides.
TEST_F(LoaderTest, GptqModelDynamicRulesApplyInTheFilesOrder) {
  using OrderedJson = nlohmann::ordered_json;
  UseFixture("llama_gptq_dynamic");
  const OrderedJson original = OrderedJson::parse(ReadAll(dir_ / "config.json"));
  auto with = [&](const std::function<void(OrderedJson&)>& edit) {
    WithOrderedQuantConfig(original, edit);
  };
  with([](OrderedJson&) {});
  EXPECT_TRUE(BuildQuantized().ok()) << BuildQuantized();
  // The same rules with their keys sorted: "+:.*\.mlp\.down_proj" (groups of 16) comes
  // first and takes layer 0's down_proj, whose tensors are per channel.
  EditConfig([](Json&) {});
  ExpectError(BuildQuantized(),
              "model.layers.0.mlp.down_proj: 1 groups of scales for 128 inputs "
              "in groups of 16");
  // A "-:" rule over a module stored quantized.
  with([](OrderedJson& q) {
    OrderedJson d = {{"-:.*layers\\.0\\.self_attn\\.o_proj", OrderedJson::object()}};
    for (const auto& [k, v] : q["dynamic"].items()) d[k] = v;
    q["dynamic"] = d;
  });
  ExpectError(BuildQuantized(),
              "model.layers.0.self_attn.o_proj: stored quantized, but the dynamic rule "
              "'-:.*layers\\.0\\.self_attn\\.o_proj' leaves it unquantized");
  // Rules the server cannot honour name themselves.
  auto rule_error = [&](const std::string& key, const OrderedJson& overrides,
                        const std::string& text) {
    with([&](OrderedJson& q) { q["dynamic"] = {{key, overrides}}; });
    ExpectError(ReadQuant(std::nullopt), text);
  };
  rule_error("(?P<layer>.*)", OrderedJson::object(),
             "dynamic rule '(?P<layer>.*)': not a regular expression this server reads");
  rule_error("-:.*down_proj", {{"bits", 8}}, "a \"-:\" rule leaves its modules unquantized");
  rule_error(".*down_proj", {{"bits", 3}}, "dynamic rule '.*down_proj': bits = 3: 4 or 8 bits");
  rule_error(".*down_proj", {{"group_size", 0}}, "group_size = 0");
  rule_error(".*down_proj", {{"sym", "no"}}, "sym = \"no\": expected true or false");
  rule_error(".*down_proj", {{"act_scale", 1}}, "key 'act_scale' is not understood");
  rule_error(".*down_proj", 8, "dynamic rule '.*down_proj' = 8: expected an object");
  with([](OrderedJson& q) { q["dynamic"] = {1, 2}; });
  ExpectError(ReadQuant(std::nullopt), "dynamic = [1,2]: expected an object");
  with([](OrderedJson& q) { q["dynamic"] = nullptr; });  // GPTQModel 1.x writes null
  EXPECT_TRUE(ReadQuant(std::nullopt).ok());
  // GPTQModel's other keys.
  auto key_error = [&](const char* key, const OrderedJson& value, const std::string& text) {
    with([&](OrderedJson& q) { q[key] = value; });
    ExpectError(ReadQuant(std::nullopt), text);
  };
  key_error("method", "awq", "method 'awq' but quant_method 'gptq'");
  key_error("format", "gptq_v2", "format 'gptq_v2' but checkpoint format 'gptq'");
  key_error("pack_dtype", "int16", "pack_dtype 'int16': codes packed in int32 words");
  key_error("rotation", "hadamard", "rotation 'hadamard': rotated checkpoints need an online");
  with([](OrderedJson& q) { q.erase("checkpoint_format"); });  // "format" alone says it
  EXPECT_TRUE(BuildQuantized().ok()) << BuildQuantized();
}

// The configs transformers' own GPTQConfig(bits=4) and AwqConfig() write (to_dict() of
// transformers 4.49; later versions add GPTQConfig's act_group_aware) load: keys that only
// steer calibration or the quantizer's runtime.
TEST_F(LoaderTest, TransformersWrittenGptqAndAwqConfigsAreRead) {
  EditConfig([](Json& c) {
    c["quantization_config"] = Json::parse(R"({"quant_method": "gptq", "bits": 4,
        "tokenizer": null, "dataset": null, "group_size": 128, "damp_percent": 0.1,
        "desc_act": false, "sym": true, "true_sequential": true, "checkpoint_format": "gptq",
        "meta": null, "backend": null, "use_cuda_fp16": false, "model_seqlen": null,
        "block_name_to_quantize": null, "module_name_preceding_first_block": null,
        "batch_size": 1, "pad_token_id": null, "use_exllama": true, "max_input_length": null,
        "exllama_config": {"version": 1}, "cache_block_outputs": true,
        "modules_in_block_to_quantize": null, "act_group_aware": true})");
  });
  EXPECT_TRUE(ReadQuant(std::nullopt).ok()) << ReadQuant(std::nullopt);
  EditConfig([](Json& c) {
    c["quantization_config"] = Json::parse(R"({"quant_method": "awq", "bits": 4,
        "group_size": 128, "zero_point": true, "version": "gemm", "backend": "autoawq",
        "fuse_max_seq_len": null, "modules_to_not_convert": null, "exllama_config": null,
        "modules_to_fuse": null, "do_fuse": false})");
  });
  EXPECT_TRUE(ReadQuant(std::nullopt).ok()) << ReadQuant(std::nullopt);
  // GPTQModel's AWQ: its format keys and sym must agree with AutoAWQ's.
  EditConfig([](Json& c) {
    auto& q = c["quantization_config"];
    q["sym"] = false;
    q["method"] = "awq";
    q["format"] = q["checkpoint_format"] = "gemm";
    q["desc_act"] = q["lm_head"] = false;
    q["pack_dtype"] = "int32";
  });
  EXPECT_TRUE(ReadQuant(std::nullopt).ok()) << ReadQuant(std::nullopt);
  EditConfig([](Json& c) { c["quantization_config"]["sym"] = true; });
  ExpectError(ReadQuant(std::nullopt), "sym = true contradicts zero_point");
  EditConfig([](Json& c) {
    c["quantization_config"]["sym"] = false;
    c["quantization_config"]["format"] = "gemv_fast";
  });
  ExpectError(ReadQuant(std::nullopt), "format 'gemv_fast': only AutoAWQ's GEMM packing");
}

// A config narrower than its checkpoint: the row-parallel weights' inputs say so, dense or
// quantized, where the first columns used to load (the output rows still select a prefix).
TEST_F(LoaderTest, RowParallelWeightsMustHaveTheConfigsInputWidth) {
  EditConfig([](Json& c) { c["intermediate_size"] = 64; });
  ExpectError(Build(),
              "model.layers.0.mlp.down_proj.weight: 128 input columns, the config says 64");
  UseFixture("llama_gptq4");
  EditConfig([](Json& c) { c["intermediate_size"] = 64; });
  ExpectError(BuildQuantized(),
              "model.layers.0.mlp.down_proj: 128 input columns, the config says 64");
}

// Intel AutoRound's checkpoints (llama_autoround: its parity tests check the values): the
// packing by packing_format (or, before 2025, backend); extra_config's exact layer names first,
// then its patterns searched in the file's order.
TEST_F(LoaderTest, AutoRoundCheckpointsAreReadStrictly) {
  using OrderedJson = nlohmann::ordered_json;
  UseFixture("llama_autoround");
  const OrderedJson original = OrderedJson::parse(ReadAll(dir_ / "config.json"));
  auto with = [&](const std::function<void(OrderedJson&)>& edit) {
    WithOrderedQuantConfig(original, edit);
  };
  with([](OrderedJson&) {});
  EXPECT_TRUE(BuildQuantized().ok()) << BuildQuantized();
  EXPECT_TRUE(ReadQuant("gptq").ok());        // AutoGPTQ's packing
  EXPECT_TRUE(ReadQuant("auto-round").ok());  // vLLM's name for the format
  ExpectError(ReadQuant("awq"), "is quantized otherwise");
  // Sorted, ".*layers\.1\..*" (4 bits in groups of 64) comes before the rule that gave layer
  // 1's gate_proj 8 bits per channel.
  EditConfig([](Json&) {});
  ExpectError(BuildQuantized(), "model.layers.1.mlp.gate_proj: ");
  // Without its exact name, layer 1's down_proj takes the pattern that matches it.
  with([](OrderedJson& q) { q["extra_config"].erase("model.layers.1.mlp.down_proj"); });
  ExpectError(BuildQuantized(), "model.layers.1.mlp.down_proj: ");
  // A layer stored quantized that a rule leaves in 16 bits.
  with([](OrderedJson& q) {
    q["extra_config"]["model.layers.0.self_attn.o_proj"] = {{"bits", 16}};
  });
  ExpectError(BuildQuantized(),
              "model.layers.0.self_attn.o_proj: stored quantized, but the "
              "dynamic rule 'model.layers.0.self_attn.o_proj' leaves it");
  // Before 2025: quant_method "intel/auto-round", the packing named by `backend`.
  with([](OrderedJson& q) {
    q["quant_method"] = "intel/auto-round";
    q.erase("packing_format");
    q["backend"] = "auto_round:gptq:exllamav2";
  });
  EXPECT_TRUE(BuildQuantized().ok()) << BuildQuantized();
  EXPECT_TRUE(ReadQuant("auto-round").ok());
  // What the server cannot honour names itself.
  auto expect = [&](const std::function<void(OrderedJson&)>& edit, const std::string& text) {
    with(edit);
    ExpectError(ReadQuant(std::nullopt), text);
  };
  expect([](OrderedJson& q) { q["packing_format"] = "auto_round:llm_compressor"; },
         "packing_format 'auto_round:llm_compressor'");
  expect([](OrderedJson& q) { q["data_type"] = "mx_fp"; }, "data_type 'mx_fp'");
  expect([](OrderedJson& q) { q["bits"] = 2; }, "bits = 2");
  expect([](OrderedJson& q) { q["super_bits"] = 6; }, "super_bits = 6");
  expect([](OrderedJson& q) { q["static_kv_dtype"] = "fp8"; }, "a quantized KV cache");
  expect(
      [](OrderedJson& q) {
        q["extra_config"]["lm_head"] = {{"bits", 3}};
      },
      "extra_config 'lm_head': bits = 3");
  expect(
      [](OrderedJson& q) {
        q["extra_config"]["lm_head"] = {{"bits", 4}, {"zp", 1}};
      },
      "key 'zp' is not understood");
  expect([](OrderedJson& q) { q["extra_config"]["(?P<x>fc1)"] = OrderedJson::object(); },
         "not a regular expression this server reads");
  expect([](OrderedJson& q) { q["iterz"] = 200; }, "key 'iterz' is not understood");
  // Its GPTQ exports (quant_method "gptq") carry its keys too (AutoRound 0.5.1's, verbatim).
  WithQuantConfig(Json::parse(R"({"act_bits": 16, "act_data_type": "int", "act_dynamic": true,
      "act_group_size": 128, "act_sym": true, "amp": true, "autoround_version": "0.5.1",
      "batch_size": 8, "bits": 4, "damp_percent": 0.01, "data_type": "int", "desc_act": false,
      "enable_minmax_tuning": true, "enable_norm_bias_tuning": false,
      "enable_quanted_input": true, "gradient_accumulate_steps": 1, "group_size": 128,
      "iters": 1000, "low_gpu_mem_usage": true, "lr": 0.001, "minmax_lr": 0.001,
      "nsamples": 512, "quant_method": "gptq", "scale_dtype": "torch.float16", "seqlen": 2048,
      "super_bits": null, "super_group_size": null, "sym": true, "to_quant_block_names": null,
      "true_sequential": false})"),
                  [](Json&) {});
  EXPECT_TRUE(ReadQuant(std::nullopt).ok()) << ReadQuant(std::nullopt);
}

// bitsandbytes' own 8-bit checkpoints (llama_bnb8: its parity tests check the values).
TEST_F(LoaderTest, BitsandbytesCheckpointsAreReadStrictly) {
  const Json bnb = UseFixture("llama_bnb8");
  EXPECT_TRUE(BuildQuantized().ok()) << BuildQuantized();
  EXPECT_TRUE(ReadQuant("bitsandbytes").ok());  // TGIS's flag names the checkpoint's method
  ExpectError(ReadQuant("gptq"), "is quantized otherwise");
  WithQuantConfig(bnb, [](Json& q) { q["load_in_4bit"] = q["_load_in_4bit"] = true; });
  ExpectError(ReadQuant(std::nullopt), "load_in_8bit and load_in_4bit are both true");
  WithQuantConfig(bnb, [](Json& q) { q["load_in_8bit"] = q["_load_in_8bit"] = false; });
  ExpectError(ReadQuant(std::nullopt), "neither load_in_8bit nor load_in_4bit is true");
  WithQuantConfig(bnb, [](Json& q) { q["llm_int8_has_fp16_weight"] = true; });
  ExpectError(ReadQuant(std::nullopt), "llm_int8_has_fp16_weight");
  WithQuantConfig(bnb, [](Json& q) { q["llm_int8_threshold"] = 0.0; });  // x stays f32
  EXPECT_TRUE(BuildQuantized().ok()) << BuildQuantized();
  WithQuantConfig(bnb, [](Json& q) { q["bnb_8bit_layout"] = "col32"; });
  ExpectError(ReadQuant(std::nullopt), "key 'bnb_8bit_layout' is not understood");
  // A layout other than row-major (weight_format 1: "col32") in one linear.
  WithQuantConfig(bnb, [](Json&) {});
  std::string bytes = ReadAll(dir_ / "model.safetensors");
  uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  const Json header = Json::parse(bytes.substr(8, n));
  const Json& at = header["model.layers.1.mlp.up_proj.weight_format"];
  ASSERT_EQ(at["dtype"], "U8");
  bytes[8 + n + at["data_offsets"][0].get<size_t>()] = 1;
  std::ofstream(dir_ / "model.safetensors", std::ios::binary | std::ios::trunc) << bytes;
  ExpectError(BuildQuantized(), "model.layers.1.mlp.up_proj: weight_format is");
}

// bitsandbytes' own 4-bit checkpoints (llama_bnb4, nf4 with double quantization, and
// llama_bnb4_fp4: their parity tests check the values): what bitsandbytes would not read the
// same way is refused, naming the linear or the record.
TEST_F(LoaderTest, Bitsandbytes4BitCheckpointsAreReadStrictly) {
  const Json bnb = UseFixture("llama_bnb4");
  EXPECT_TRUE(BuildQuantized().ok()) << BuildQuantized();
  EXPECT_TRUE(ReadQuant("bitsandbytes").ok());  // TGIS's flag names the checkpoint's method
  ExpectError(ReadQuant("awq"), "is quantized otherwise");
  WithQuantConfig(bnb, [](Json& q) { q["bnb_4bit_quant_type"] = "int4"; });
  ExpectError(ReadQuant(std::nullopt), "bnb_4bit_quant_type 'int4'");
  WithQuantConfig(bnb, [](Json& q) { q["bnb_4bit_quant_storage"] = "bfloat16"; });
  ExpectError(ReadQuant(std::nullopt), "bnb_4bit_quant_storage 'bfloat16'");
  WithQuantConfig(bnb, [](Json& q) { q["bnb_4bit_compute_dtype"] = "bfloat16"; });  // x is f32
  EXPECT_TRUE(BuildQuantized().ok()) << BuildQuantized();

  const std::string pristine = ReadAll(dir_ / "model.safetensors");
  const std::string record = "model.layers.1.mlp.up_proj.weight.quant_state.bitsandbytes__nf4";
  // Edits the file's bytes (header and data) and expects the load to fail with `text`.
  auto expect_file_error = [&](const std::function<void()>& edit, const std::string& text) {
    uint64_t n;
    std::memcpy(&n, pristine.data(), 8);
    header_ = Json::parse(pristine.substr(8, n));
    data_ = pristine.substr(8 + n);
    edit();
    Save();
    ExpectError(BuildQuantized(), text);
  };
  // An edit of the JSON record (the tensors after it move by the change in its length, padded
  // with spaces, which JSON allows, to a multiple of 8 so that they stay aligned).
  auto in_record = [&](const std::string& from, std::string to) {
    while (to.size() < from.size() || (to.size() - from.size()) % 8 != 0) to += ' ';
    return [&, from, to] {
      const size_t begin = header_[record]["data_offsets"][0].get<size_t>();
      const size_t end = header_[record]["data_offsets"][1].get<size_t>();
      const size_t i = data_.substr(begin, end - begin).find(from);
      ASSERT_NE(i, std::string::npos) << from;
      data_.replace(begin + i, from.size(), to);
      const int64_t moved = static_cast<int64_t>(to.size()) - static_cast<int64_t>(from.size());
      ShiftOffsetsFrom(&header_, end, moved);
      header_[record]["shape"] = {end - begin + moved};
    };
  };
  expect_file_error(in_record("\"blocksize\": 64", "\"blocksize\": 48"),
                    "up_proj: blocks of 48 weights run across rows of 64");
  // A shape whose product overflows int64 is compared with the bytes without overflowing.
  expect_file_error(in_record("\"shape\": [128, 64]", "\"shape\": [4294967297, 2147483648]"),
                    "up_proj: weight is");
  expect_file_error(in_record("\"dtype\": \"float32\"", "\"dtype\": \"float64\""),
                    record + ": dtype 'float64'");
  expect_file_error(in_record("\"quant_type\": \"nf4\"", "\"quant_type\": \"fp4\""),
                    record + ": quant_type 'fp4' in a record named nf4");
  expect_file_error(in_record("\"nested_dtype\"", "\"nested_dtyp_\""),
                    record + ": key 'nested_dtyp_' is not understood");
  expect_file_error(
      [&] {
        const Json& at = header_["model.layers.0.self_attn.k_proj.weight.quant_map"];
        data_[at["data_offsets"][0].get<size_t>()] ^= 1;  // the low bit of table[0]
      },
      "self_attn.k_proj: quant_map differs from bitsandbytes' nf4 table");
  expect_file_error(
      [&] {
        const Json& at = header_["model.layers.0.mlp.down_proj.weight.nested_absmax"];
        const float nan = std::numeric_limits<float>::quiet_NaN();
        std::memcpy(&data_[at["data_offsets"][0].get<size_t>()], &nan, 4);
      },
      "model.layers.0.mlp.down_proj.weight.absmax: block 0's absmax is nan");
  // Packed codes whose record is missing would be read as numbers.
  expect_file_error(
      [&] {
        header_["model.layers.1.mlp.up_proj.weight.quant_state.other"] = header_[record];
        header_.erase(record);
      },
      "model.layers.1.mlp.up_proj.weight: uint8 without a quant_state.bitsandbytes__nf4");
}

// --quantize bitsandbytes-nf4 / -fp4 (TGI's): dense weights to 4-bit codes at load (llama_nf4's
// parity tests check the values); refusals name the tensor.
TEST_F(LoaderTest, Bitsandbytes4BitAtLoadIsForDenseCheckpoints) {
  EXPECT_TRUE(BuildQuantized("bitsandbytes-nf4").ok()) << BuildQuantized("bitsandbytes-nf4");
  EXPECT_TRUE(BuildQuantized("bitsandbytes-fp4").ok()) << BuildQuantized("bitsandbytes-fp4");
  ExpectError(ReadQuant("bitsandbytes-int4"), "expected one of gptq, bitsandbytes,");
  const Json& at = header_["model.layers.0.self_attn.o_proj.weight"];
  ASSERT_EQ(at["dtype"], "F32");
  const int64_t cols = at["shape"][1].get<int64_t>();
  const float inf = std::numeric_limits<float>::infinity();
  std::memcpy(&data_[at["data_offsets"][0].get<size_t>() + 4 * (3 * cols + 7)], &inf, 4);
  Save();
  ExpectError(BuildQuantized("bitsandbytes-nf4"),
              "model.layers.0.self_attn.o_proj.weight: row 3 holds a NaN or an infinity");
  ExpectError(BuildQuantized("bitsandbytes-nf4"), "model.safetensors");
  // Rows that are not whole blocks of 64 would put one block across two rows.
  std::vector<float> v(2 * 96, 0.5f);
  auto odd = tgis::server::QuantizeBnb4AtLoad(tgis::kernels::Tensor::FromVector(v, {2, 96}), "nf4",
                                              {0, 96}, "w");
  ExpectError(odd.status(), "w: rows of 96 weights are not whole blocks of 64");
  UseFixture("llama_gptq4");
  ExpectError(ReadQuant("bitsandbytes-nf4"),
              "--quantize bitsandbytes-nf4: the checkpoint is "
              "already quantized");
  UseFixture("llama_bnb4");  // bitsandbytes' own 4-bit codes: served as they are
  EXPECT_TRUE(BuildQuantized("bitsandbytes-nf4").ok()) << BuildQuantized("bitsandbytes-nf4");
}

// --quantize bitsandbytes over a weight with a NaN: int8 has no such value, so the load fails
// naming the tensor, the row and the file (the codes were undefined behaviour before).
TEST_F(LoaderTest, Int8AtLoadRefusesNonFiniteWeights) {
  EXPECT_TRUE(BuildQuantized("bitsandbytes").ok()) << BuildQuantized("bitsandbytes");
  const Json& at = header_["model.layers.1.mlp.down_proj.weight"];
  ASSERT_EQ(at["dtype"], "F32");
  const int64_t cols = at["shape"][1].get<int64_t>();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(&data_[at["data_offsets"][0].get<size_t>() + 4 * (5 * cols + 2)], &nan, 4);
  Save();
  ExpectError(BuildQuantized("bitsandbytes"),
              "model.layers.1.mlp.down_proj.weight: row 5 holds a NaN or an infinity");
  ExpectError(BuildQuantized("bitsandbytes"), "model.safetensors");
}

TEST_F(LoaderTest, Fp8ConfigsAreReadStrictly) {
  auto read = [&](std::optional<std::string> flag) {
    auto config = tgis::server::ModelConfig::Load(dir_.string());
    EXPECT_TRUE(config.ok()) << config.status();
    return tgis::server::ReadQuantConfig(dir_.string(), *config, flag).status();
  };
  auto expect_error = [&](const std::string& text, std::optional<std::string> flag = {}) {
    const absl::Status st = read(flag);
    EXPECT_FALSE(st.ok()) << text;
    EXPECT_NE(st.message().find(text), std::string::npos) << st;
  };
  expect_error("has no quantization config", "fp8");
  // The compressed-tensors config llm-compressor writes (the fixture's).
  const Json fixture =
      Json::parse(ReadAll(fs::path(TGIS_FIXTURES_DIR) / "models" / "llama_fp8" / "config.json"));
  const Json ct = fixture["quantization_config"];
  auto with = [&](const std::function<void(Json&)>& edit) { WithQuantConfig(ct, edit); };
  with([](Json&) {});
  EXPECT_TRUE(read(std::nullopt).ok()) << read(std::nullopt);
  EXPECT_TRUE(read("fp8").ok());
  EXPECT_TRUE(read("compressed-tensors").ok());
  expect_error("already quantized", "bitsandbytes");
  expect_error("is quantized otherwise", "gptq");
  with([](Json& q) { q["config_groups"]["group_0"]["weights"]["type"] = "int"; });
  expect_error("group_0: format 'float-quantized' for integer weights");
  with([](Json& q) { q["config_groups"]["group_0"]["weights"]["strategy"] = "group"; });
  expect_error("weights: strategy 'group'");
  with([](Json& q) { q["config_groups"]["group_0"]["weights"]["block_structure"] = {128, 128}; });
  expect_error("block_structure = [128,128] with strategy 'tensor'");
  with([](Json& q) { q["config_groups"]["group_0"]["weights"]["strategy"] = "block"; });
  expect_error("block_structure = null: the block strategy needs [rows, columns]");
  with([](Json& q) {
    q["config_groups"]["group_0"]["weights"]["strategy"] = "block";
    q["config_groups"]["group_0"]["weights"]["block_structure"] = {128, 128};
  });
  EXPECT_TRUE(read(std::nullopt).ok()) << read(std::nullopt);
  with([](Json& q) { q["config_groups"]["group_0"]["weights"]["symmetric"] = false; });
  expect_error("symmetric = false");
  with([](Json& q) {
    q["config_groups"]["group_0"]["output_activations"] = q["config_groups"]["group_0"]["weights"];
  });
  expect_error("output_activations");
  with([](Json& q) { q["kv_cache_scheme"] = {{"num_bits", 8}, {"type", "float"}}; });
  expect_error("kv_cache_scheme");
  with([](Json& q) { q["format"] = "pack-quantized"; });
  expect_error("format 'pack-quantized'");
  with([](Json& q) { q["config_groups"]["group_0"]["weights"]["num_bits"] = "8"; });
  expect_error("num_bits = \"8\": expected an integer");
  with([](Json& q) { q["transform"] = true; });
  expect_error("key 'transform' is not understood");
  with([](Json& q) { q["moe_sparsity_config"] = nullptr; });  // compressed-tensors 0.20 writes
  EXPECT_TRUE(read(std::nullopt).ok()) << read(std::nullopt);
  with([](Json& q) { q["moe_sparsity_config"] = {{"method", "prune"}}; });
  expect_error("moe_sparsity_config = {\"method\":\"prune\"}: not supported");
  EditConfig([&](Json& c) {
    c["quantization_config"] = {{"quant_method", "fbgemm_fp8"}, {"activation_scale_ub", 1200.0}};
  });
  EXPECT_TRUE(read(std::nullopt).ok());
  EditConfig([&](Json& c) { c["quantization_config"]["input_scale"] = 1; });
  expect_error("key 'input_scale' is not understood");
}

// compressed-tensors integer checkpoints (llm-compressor's W4A16, W8A16, W8A8): the config's
// schemes are checked key by key, and each linear's tensors against them.
TEST_F(LoaderTest, CompressedIntConfigsAndTensorsAreReadStrictly) {
  const Json ct = UseFixture("llama_ct_w4a16");
  auto with = [&](const std::function<void(Json&)>& edit) { WithQuantConfig(ct, edit); };
  EXPECT_TRUE(ReadQuant(std::nullopt).ok()) << ReadQuant(std::nullopt);
  EXPECT_TRUE(ReadQuant("compressed-tensors").ok()) << "vLLM's --quantization value";
  EXPECT_TRUE(BuildQuantized().ok()) << BuildQuantized();
  ExpectError(ReadQuant("bitsandbytes"), "already quantized");
  ExpectError(ReadQuant("gptq"), "is quantized otherwise");
  ExpectError(ReadQuant("fp8"), "is quantized otherwise");
  auto with_weights = [&](const std::function<void(Json&)>& edit) {
    with([&](Json& q) { edit(q["config_groups"]["group_0"]["weights"]); });
  };
  with_weights([](Json& w) { w["num_bits"] = 2; });
  ExpectError(ReadQuant(std::nullopt),
              "weights: num_bits 2, type 'int': float8 weights and integer ones");
  with_weights([](Json& w) { w["strategy"] = "block"; });
  ExpectError(ReadQuant(std::nullopt), "weights: strategy 'block'");
  with_weights([](Json& w) { w["group_size"] = nullptr; });
  ExpectError(ReadQuant(std::nullopt), "group_size = -1: the group strategy needs one > 0");
  with_weights([](Json& w) { w["dynamic"] = true; });
  ExpectError(ReadQuant(std::nullopt), "dynamically quantized weights");
  with_weights([](Json& w) { w["actorder"] = "random"; });
  ExpectError(ReadQuant(std::nullopt), "actorder = \"random\"");
  with_weights([](Json& w) { w["actorder"] = "weight"; });
  EXPECT_TRUE(ReadQuant(std::nullopt).ok())
      << "actorder weight changes calibration, not the tensors";
  with_weights([](Json& w) { w["zero_point_bits"] = 4; });
  ExpectError(ReadQuant(std::nullopt), "key 'zero_point_bits' is not understood");
  with([](Json& q) {
    q["config_groups"]["group_1"] = q["config_groups"]["group_0"];
    q["config_groups"]["group_1"]["weights"]["type"] = "float";
    q["config_groups"]["group_1"]["weights"]["num_bits"] = 8;
    q["config_groups"]["group_1"]["weights"]["strategy"] = "channel";
    q["config_groups"]["group_1"]["weights"]["group_size"] = nullptr;
    q["config_groups"]["group_1"]["weights"]["symmetric"] = true;
    q["config_groups"]["group_1"]["format"] = "float-quantized";
  });
  ExpectError(ReadQuant(std::nullopt),
              "float8 and integer weights in one checkpoint are not supported");
  with([](Json& q) {
    q["config_groups"]["group_0"]["input_activations"] = {
        {"num_bits", 4}, {"type", "int"}, {"strategy", "token"}, {"dynamic", true}};
  });
  ExpectError(ReadQuant(std::nullopt),
              "input_activations: num_bits 4, type 'int': 8-bit activation schemes");
  with([](Json& q) { q["config_groups"]["group_0"]["format"] = "float-quantized"; });
  ExpectError(ReadQuant(std::nullopt), "format 'float-quantized' for integer weights");
  // The tensors against the config: groups of 64 where the scales hold groups of 32, codes
  // said to be 8-bit where they are packed 4 to a byte.
  with_weights([](Json& w) { w["group_size"] = 64; });
  ExpectError(BuildQuantized(),
              "self_attn.q_proj: 2 groups of scales for 64 columns in groups of 64");
  with_weights([](Json& w) { w["num_bits"] = 8; });
  ExpectError(BuildQuantized(),
              "self_attn.q_proj: weight_packed holds 4-bit codes, the config says 8");
}

// transformers' fine-grained fp8 (DeepSeek-V3, Qwen3 FP8): a factor per block of weights.
TEST_F(LoaderTest, BlockFp8ConfigsAndScalesAreReadStrictly) {
  const Json fp8 = UseFixture("llama_fp8_block");
  auto with = [&](const std::function<void(Json&)>& edit) { WithQuantConfig(fp8, edit); };
  EXPECT_TRUE(ReadQuant(std::nullopt).ok()) << ReadQuant(std::nullopt);
  EXPECT_TRUE(ReadQuant("fp8").ok());
  EXPECT_TRUE(BuildQuantized().ok()) << BuildQuantized();
  ExpectError(ReadQuant("gptq"), "is quantized otherwise");
  ExpectError(ReadQuant("compressed-tensors"), "is quantized otherwise");
  with([](Json& q) { q["weight_block_size"] = {0, 128}; });
  ExpectError(ReadQuant(std::nullopt),
              "weight_block_size = [0,128]: expected two positive integers");
  with([](Json& q) { q["activation_scheme"] = "per-token"; });
  ExpectError(ReadQuant(std::nullopt), "activation_scheme 'per-token': expected dynamic or static");
  with([](Json& q) { q["fmt"] = "e5m2"; });
  ExpectError(ReadQuant(std::nullopt), "fmt 'e5m2'");
  with([](Json& q) { q["weight_block_sizes"] = {128, 128}; });
  ExpectError(ReadQuant(std::nullopt), "key 'weight_block_sizes' is not understood");
  // Scales of blocks of [48, 32] weights read as blocks of [64, 32]: 2 blocks of rows where
  // 1 is expected.
  with([](Json& q) { q["weight_block_size"] = {64, 32}; });
  ExpectError(BuildQuantized(), "self_attn.q_proj: weight_scale_inv is");
  ExpectError(BuildQuantized(), "for blocks of [64, 32] weights");
}

TEST_F(LoaderTest, Fp8WeightsWithoutAnFp8ConfigAreRefusedByName) {
  // The fp8 fixture's tensors under a config that does not say fp8: the values mean nothing
  // without their scales, so the dense path must not read them.
  fs::copy(fs::path(TGIS_FIXTURES_DIR) / "models" / "llama_fp8" / "model.safetensors",
           dir_ / "model.safetensors", fs::copy_options::overwrite_existing);
  const absl::Status st = Build();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("is float8 e4m3: expected only as the linear weight of an fp8 "
                              "checkpoint"),
            std::string::npos)
      << st;
}

// Resident kB of this process's mappings of `file` (/proc/self/smaps), -1 where none is.
int64_t MappedResidentKb(const fs::path& file) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  int64_t kb = -1;
  bool in_file = false;
  while (std::getline(smaps, line)) {
    // A mapping's first line starts with its address range (lower-case hex); its fields'
    // lines with a capitalised name.
    const bool header = !line.empty() && (std::isdigit(static_cast<unsigned char>(line[0])) ||
                                          (line[0] >= 'a' && line[0] <= 'f'));
    if (header) {
      in_file =
          line.size() >= file.string().size() &&
          line.compare(line.size() - file.string().size(), std::string::npos, file.string()) == 0;
    } else if (in_file && line.rfind("Rss:", 0) == 0) {
      kb = std::max<int64_t>(kb, 0) + std::stoll(line.substr(4));
    }
  }
  return kb;
}

// After load the files' pages leave the process (the model copied what it converted); a view
// the model kept still reads the file's values, its pages coming back as it touches them.
TEST_F(LoaderTest, ReleasedPagesLeaveTheProcessAndViewsStillRead) {
  const fs::path file = fs::canonical(dir_ / "model.safetensors");
  auto weights = tgis::server::WeightStore::Open(dir_.string());
  ASSERT_TRUE(weights.ok()) << weights.status();
  auto view = (*weights)->Get("model.norm.weight", tgis::kernels::DType::kF32);
  ASSERT_TRUE(view.ok()) << view.status();
  std::vector<float> before(view->data<float>(), view->data<float>() + view->numel());
  int touched = 0;                                       // kept, so that the reads are made
  for (const std::string& name : (*weights)->Names()) {  // every page touched
    auto t = (*weights)->View(name);
    ASSERT_TRUE(t.ok());
    uint8_t sum = 0;
    for (size_t i = 0; i < t->nbytes(); i += 1024) sum ^= static_cast<const uint8_t*>(t->raw())[i];
    touched += sum;
  }
  ASSERT_GT(MappedResidentKb(file), 100) << "the whole fixture file (800 KB) was read " << touched;
  (*weights)->ReleaseMappedPages();
  EXPECT_EQ(MappedResidentKb(file), 0);
  weights->reset();  // the view keeps the file mapped
  EXPECT_EQ(MappedResidentKb(file), 0);
  EXPECT_EQ(std::vector<float>(view->data<float>(), view->data<float>() + view->numel()), before);
  EXPECT_GT(MappedResidentKb(file), 0) << "the view's page came back";
  *view = tgis::kernels::Tensor();
  EXPECT_EQ(MappedResidentKb(file), -1) << "the last view gone, the file is unmapped";
}

TEST_F(LoaderTest, AnUnservableConfigNamesTheKeyAndValue) {
  EditConfig([](Json& c) { c["hidden_size"] = "sixty-four"; });
  absl::Status st = Build();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("hidden_size = \"sixty-four\""), std::string::npos) << st;

  EditConfig([](Json& c) {
    c["hidden_size"] = 64;
    c["rope_scaling"] = {{"rope_type", "mrope"}, {"factor", 2.0}};
  });
  st = Build();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("rope_scaling.rope_type = \"mrope\""), std::string::npos) << st;

  EditConfig([](Json& c) { c["rope_scaling"] = {{"type", "linear"}, {"factor", "x"}}; });
  st = Build();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("rope_scaling.factor = \"x\""), std::string::npos) << st;

  // Found by the model_config fuzz target: a number beyond double is nlohmann's out_of_range,
  // which ended the process uncaught.
  std::ofstream(dir_ / "config.json", std::ios::trunc) << R"({"model_type": "llama", "x": 1e500})";
  st = Build();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("config.json: invalid JSON"), std::string::npos) << st;
  fs::copy(fs::path(TGIS_FIXTURES_DIR) / "models" / "llama" / "config.json", dir_ / "config.json",
           fs::copy_options::overwrite_existing);

  // Found by the model_config fuzz target: a factor that scales the context beyond int64 was
  // cast anyway (undefined behaviour); so was a llama3 original context beyond it.
  // Found by the model_config fuzz target: an integer key given as a float beyond int64 was
  // converted anyway (undefined behaviour); 128.5 was truncated. Floats are refused, as the
  // hidden size's reader already did.
  for (double v : {6.7e27, 128.5, 128.0}) {
    EditConfig([v](Json& c) { c["intermediate_size"] = v; });
    st = Build();
    ASSERT_FALSE(st.ok());
    EXPECT_NE(st.message().find("config.json: intermediate_size = " + Json(v).dump() +
                                ": expected an integer"),
              std::string::npos)
        << st;
  }
  EditConfig([](Json& c) { c["intermediate_size"] = 128; });

  EditConfig([](Json& c) { c["rope_scaling"] = {{"type", "linear"}, {"factor", 8.9e28}}; });
  st = Build();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("rope_scaling.factor = 8.9e+28: gives a position count beyond"),
            std::string::npos)
      << st;
  EditConfig([](Json& c) {
    c["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", 8.0},
                         {"low_freq_factor", 1.0},
                         {"high_freq_factor", 4.0},
                         {"original_max_position_embeddings", 1e30}};
  });
  st = Build();
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("rope_scaling.original_max_position_embeddings = 1e+30"),
            std::string::npos)
      << st;
}

// The spec of the fixture `name` built with its config.json edited by `edit` (and, when given,
// its safetensors header by `edit_header`: tensor names), or why it did not build.
absl::StatusOr<tgis::server::DecoderSpec> FixtureSpecWith(
    const std::string& name, const std::function<void(Json&)>& edit,
    const std::function<void(Json&)>& edit_header = nullptr) {
  char tmpl[] = "/tmp/tgis-config-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return absl::InternalError("mkdtemp failed");
  const fs::path dir = tmpl, src = fs::path(TGIS_FIXTURES_DIR) / "models" / name;
  if (edit_header) {
    const std::string file = ReadAll(src / "model.safetensors");
    uint64_t n = 0;
    std::memcpy(&n, file.data(), 8);
    Json header = Json::parse(file.substr(8, n));
    edit_header(header);
    WriteSafetensors(dir / "model.safetensors", header, file.substr(8 + n));
  } else {
    fs::copy(src / "model.safetensors", dir / "model.safetensors");
  }
  Json c = Json::parse(ReadAll(src / "config.json"));
  edit(c);
  std::ofstream(dir / "config.json", std::ios::trunc) << c.dump();
  absl::StatusOr<tgis::server::DecoderSpec> spec =
      [&]() -> absl::StatusOr<tgis::server::DecoderSpec> {
    auto config = tgis::server::ModelRegistry::Get().LoadConfig(dir.string());
    if (!config.ok()) return config.status();
    auto weights = tgis::server::ModelRegistry::OpenWeights(dir.string(), *config);
    if (!weights.ok()) return weights.status();
    auto quant = tgis::server::ReadQuantConfig(dir.string(), *config, std::nullopt);
    if (!quant.ok()) return quant.status();
    (*weights)->set_quantization(*quant);
    auto model =
        tgis::server::ModelRegistry::Get().Build(*config, **weights, tgis::kernels::DType::kF32);
    if (!model.ok()) return model.status();
    return (*model)->spec();
  }();
  fs::remove_all(dir);
  return spec;
}

absl::Status BuildFixtureWith(const std::string& name, const std::function<void(Json&)>& edit) {
  return FixtureSpecWith(name, edit).status();
}

void ExpectBuildError(const absl::Status& st, const std::string& text) {
  ASSERT_FALSE(st.ok()) << "expected an error with: " << text;
  EXPECT_NE(st.message().find(text), std::string::npos) << st;
}

// Found by the model_config fuzz target: GPT-NeoX's rotary_pct giving an odd rotary dimension
// failed a kernel check (the process died), and a huge one made a float-to-int cast undefined.
TEST(ModelConfigTest, GptNeoxRotaryPctMustGiveAnEvenRotaryDimension) {
  for (double pct : {0.7, 1e30}) {  // head_dim 16: 11.2 rotary dimensions; then far too many
    ExpectBuildError(BuildFixtureWith("gpt_neox", [&](Json& c) { c["rotary_pct"] = pct; }),
                     "config.json: rotary_pct = ");
  }
}

// Phi-3's partial_rotary_factor follows the same rule; LongRoPE's attention factor on a partial
// rotation (Phi-4-mini) is refused by name rather than computed otherwise than transformers.
TEST(ModelConfigTest, Phi3PartialRotationIsCheckedAndLongRopeOnItRefused) {
  EXPECT_TRUE(BuildFixtureWith("phi3", [](Json&) {}).ok());
  ExpectBuildError(BuildFixtureWith("phi3", [](Json& c) { c["partial_rotary_factor"] = 0.35; }),
                   "config.json: partial_rotary_factor = 0.35 gives head_dim 16");
  ExpectBuildError(BuildFixtureWith("phi3",
                                    [](Json& c) {
                                      c["original_max_position_embeddings"] = 32;
                                      c["rope_scaling"] = {
                                          {"type", "longrope"},
                                          {"short_factor", std::vector<double>(4, 1.0)},
                                          {"long_factor", std::vector<double>(4, 2.0)}};
                                    }),
                   "attention factor on a partial rotary dimension is not supported");
}

// Granite's multipliers: numbers, finite and non-zero (logits_scaling divides).
TEST(ModelConfigTest, GraniteMultipliersMustBeFiniteNonZeroNumbers) {
  EXPECT_TRUE(BuildFixtureWith("granite", [](Json&) {}).ok());
  ExpectBuildError(BuildFixtureWith("granite", [](Json& c) { c["logits_scaling"] = 0.0; }),
                   "config.json: logits_scaling = 0: expected a finite, non-zero number");
  ExpectBuildError(BuildFixtureWith("granite", [](Json& c) { c["residual_multiplier"] = "0.22"; }),
                   "config.json: residual_multiplier = \"0.22\": wrong type");
  ExpectBuildError(BuildFixtureWith("granite", [](Json& c) { c["embedding_multiplier"] = 1e300; }),
                   "embedding_multiplier");
}

// GraniteMoeHybrid (Granite 4.0): attention and Mamba-2 layers as layer_types says (absent:
// every layer Mamba-2, as transformers makes it); rotary or no positions; the dense shared MLP
// without experts, GraniteMoeShared's layout with them; Mamba-2 sizes checked, served at one
// rank.
// GPT-OSS: biases everywhere, sinks, windows on the even layers (layer_types, or GptOssConfig's
// rule without it), YaRN, the clamped SwiGLU's limit, top-k-then-softmax routing; MXFP4
// experts read through their blocks and scales, and each misfit named.
TEST(ModelConfigTest, GptOssReadsItsLayoutAndMxfp4Experts) {
  for (const char* name : {"gpt_oss", "gpt_oss_mxfp4"}) {
    SCOPED_TRACE(name);
    auto spec = FixtureSpecWith(name, [](Json&) {});
    ASSERT_TRUE(spec.ok()) << spec.status();
    EXPECT_EQ(spec->layer_windows, (std::vector<int>{8, 0}));
    EXPECT_EQ(spec->num_experts, 4);
    EXPECT_EQ(spec->experts_per_token, 2);
    EXPECT_EQ(spec->routing, tgis::server::ExpertRouting::kTopKSoftmax);
    EXPECT_FLOAT_EQ(spec->glu_limit, 7.0f);
    EXPECT_FLOAT_EQ(spec->glu_alpha, 1.702f);
    // YaRN's attention factor (0.1 ln(256 / 64) + 1, squared) folded into the scale.
    EXPECT_NEAR(spec->attn_scale, 0.25 * std::pow(0.1 * std::log(4.0) + 1, 2), 1e-6);
  }
  auto derived = FixtureSpecWith("gpt_oss", [](Json& c) { c.erase("layer_types"); });
  ASSERT_TRUE(derived.ok()) << derived.status();
  EXPECT_EQ(derived->layer_windows, (std::vector<int>{8, 0}));
  auto limit = FixtureSpecWith("gpt_oss", [](Json& c) { c["swiglu_limit"] = 3.5; });
  ASSERT_TRUE(limit.ok()) << limit.status();
  EXPECT_FLOAT_EQ(limit->glu_limit, 3.5f);
  ExpectBuildError(BuildFixtureWith("gpt_oss", [](Json& c) { c["swiglu_limit"] = 0; }),
                   "config.json: swiglu_limit = 0: expected a positive, finite number");
  ExpectBuildError(FixtureSpecWith(
                       "gpt_oss", [](Json&) {},
                       [](Json& h) {
                         h["model.layers.1.self_attn.sinkz"] = h["model.layers.1.self_attn.sinks"];
                         h.erase("model.layers.1.self_attn.sinks");
                       })
                       .status(),
                   "model.layers.1.self_attn.sinks");
  ExpectBuildError(BuildFixtureWith("gpt_oss_mxfp4",
                                    [](Json& c) { c["quantization_config"]["group_size"] = 64; }),
                   "key 'group_size' is not understood");
  ExpectBuildError(FixtureSpecWith(
                       "gpt_oss_mxfp4", [](Json&) {},
                       [](Json& h) {
                         const std::string scales = "model.layers.0.mlp.experts.down_proj_scales";
                         h[scales + "_"] = h[scales];
                         h.erase(scales);
                       })
                       .status(),
                   "model.layers.0.mlp.experts.down_proj_scales");
  ExpectBuildError(
      FixtureSpecWith(
          "gpt_oss_mxfp4", [](Json&) {},
          [](Json& h) { h["model.layers.1.mlp.experts.gate_up_proj_blocks"]["dtype"] = "I8"; })
          .status(),
      "model.layers.1.mlp.experts.gate_up_proj_blocks (i8 [4, 128, 2, 16]) and "
      "model.layers.1.mlp.experts.gate_up_proj_scales (u8 [4, 128, 2]): expected uint8 "
      "[4, out, in / 32, 16] and [4, out, in / 32] (MXFP4");
  // Without its quantization_config the blocks are not read as MXFP4: named, never ignored.
  ExpectBuildError(
      BuildFixtureWith("gpt_oss_mxfp4", [](Json& c) { c.erase("quantization_config"); }),
      "model.layers.0.mlp.experts.gate_up_proj");
}

TEST(ModelConfigTest, GraniteHybridReadsLayerTypesAndMambaSizes) {
  auto micro = FixtureSpecWith("granite4_micro", [](Json&) {});
  ASSERT_TRUE(micro.ok()) << micro.status();
  EXPECT_EQ(micro->position, tgis::server::PositionKind::kRotary);
  EXPECT_EQ(micro->num_experts, 0);
  EXPECT_EQ(micro->intermediate, 96);  // shared_intermediate_size, not intermediate_size
  EXPECT_TRUE(micro->RecurrentStateShapes().empty());
  auto nope = FixtureSpecWith("granite4_nope", [](Json&) {});
  ASSERT_TRUE(nope.ok()) << nope.status();
  EXPECT_EQ(nope->position, tgis::server::PositionKind::kNone);
  EXPECT_EQ(nope->num_experts, 4);
  EXPECT_EQ(nope->shared_expert_intermediate, 96);
  EXPECT_FALSE(nope->shared_expert_gated);
  auto hybrid = FixtureSpecWith("granite4_h", [](Json&) {});
  ASSERT_TRUE(hybrid.ok()) << hybrid.status();
  EXPECT_EQ(hybrid->mamba_layers, (std::vector<bool>{true, false}));
  EXPECT_EQ(hybrid->RecurrentStateShapes(),
            (std::vector<tgis::kernels::Shape>{{128 + 2 * 2 * 16, 3}, {8, 16, 16}}));
  // layers_block_type is layer_types' older name; without either every layer is Mamba-2.
  ExpectBuildError(BuildFixtureWith("granite4_micro",
                                    [](Json& c) {
                                      c.erase("layer_types");
                                      c["layers_block_type"] = {"mamba", "attention"};
                                    }),
                   "model.layers.0.mamba.in_proj.weight");
  ExpectBuildError(BuildFixtureWith("granite4_micro", [](Json& c) { c.erase("layer_types"); }),
                   "model.layers.0.mamba.in_proj.weight");
  ExpectBuildError(BuildFixtureWith("granite4_h", [](Json& c) { c["mamba_n_groups"] = 3; }),
                   "config.json: the Mamba-2 sizes (mamba_n_heads 8, mamba_d_head 16, "
                   "mamba_n_groups 3");
  // Sizes whose products could overflow are refused before any is multiplied.
  ExpectBuildError(BuildFixtureWith("granite4_h", [](Json& c) { c["mamba_expand"] = 1e300; }),
                   "config.json: mamba_expand = 1e+300: the expanded width must be in [1, 2^31]");
  ExpectBuildError(
      BuildFixtureWith("granite4_h", [](Json& c) { c["mamba_d_state"] = int64_t{1} << 40; }),
      "config.json: mamba_d_state = 1099511627776: at most 1048576");
  ExpectBuildError(
      BuildFixtureWith("granite4_h", [](Json& c) { c["mamba_d_head"] = int64_t{1} << 62; }),
      "config.json: mamba_d_head = 4611686018427387904: at most 1048576");
  ExpectBuildError(BuildFixtureWith("granite4_h", [](Json& c) { c["mamba_d_head"] = 8; }),
                   "heads x head_dim the expanded width");
  ExpectBuildError(BuildFixtureWith("granite4_h", [](Json& c) { c["hidden_act"] = "gelu"; }),
                   "config.json: hidden_act = \"gelu\": Mamba-2 layers are served with silu only");
  ExpectBuildError(BuildFixtureWith("granite4_h", [](Json& c) { c["mamba_d_conv"] = 3; }),
                   "model.layers.0.mamba.conv1d.weight: expected [192, 1, 3], found [192, 1, 4]");
  // Under tensor parallelism each rank holds half the mixer's heads and, of its two groups,
  // the one they read: its states are that part's.
  struct TwoRanks : tgis::server::Communicator {
    int rank() const override { return 0; }
    int world_size() const override { return 2; }
    void AllReduceSum(tgis::kernels::Tensor*) override { ADD_FAILURE() << "no collective"; }
    void AllReduceMin(std::span<int64_t>) override { ADD_FAILURE() << "no collective"; }
    void AllGather(const tgis::kernels::Tensor&, tgis::kernels::Tensor*) override {
      ADD_FAILURE() << "no collective";
    }
    void Broadcast(tgis::kernels::Tensor*, int) override { ADD_FAILURE() << "no collective"; }
    void Barrier() override { ADD_FAILURE() << "no collective"; }
  };
  const std::string dir = (fs::path(TGIS_FIXTURES_DIR) / "models" / "granite4_h").string();
  auto config = tgis::server::ModelRegistry::Get().LoadConfig(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  auto weights = tgis::server::ModelRegistry::OpenWeights(dir, *config);
  ASSERT_TRUE(weights.ok()) << weights.status();
  auto half = tgis::server::ModelRegistry::Get().Build(
      *config, **weights, tgis::kernels::DType::kF32, std::make_shared<TwoRanks>());
  ASSERT_TRUE(half.ok()) << half.status();
  // 4 heads of 16 and one group of state 16: conv channels 64 + 2 * 16, kernel 4.
  EXPECT_EQ((*half)->spec().RecurrentStateShapes(),
            (std::vector<tgis::kernels::Shape>{{96, 3}, {4, 16, 16}}));
  ExpectBuildError(
      BuildFixtureWith("granite4_micro", [](Json& c) { c["layer_types"] = {"attention"}; }),
      "expected one entry per layer (2)");
  ExpectBuildError(BuildFixtureWith("granite4_micro",
                                    [](Json& c) {
                                      c["layer_types"] = {"attention", "conv"};
                                    }),
                   "config.json: layer_types holds \"conv\"");
  ExpectBuildError(
      BuildFixtureWith("granite4_micro", [](Json& c) { c["position_embedding_type"] = "alibi"; }),
      "config.json: position_embedding_type = \"alibi\": expected \"rope\", \"nope\" or null");
  auto null_positions =
      FixtureSpecWith("granite4_micro", [](Json& c) { c["position_embedding_type"] = nullptr; });
  ASSERT_TRUE(null_positions.ok()) << null_positions.status();
  EXPECT_EQ(null_positions->position, tgis::server::PositionKind::kNone);
  ExpectBuildError(
      BuildFixtureWith("granite4_nope", [](Json& c) { c["shared_intermediate_size"] = -1; }),
      "config.json: shared_intermediate_size = -1: expected 0 or more");
  // Without shared_intermediate_size (0), GraniteMoeShared is GraniteMoE.
  EXPECT_TRUE(
      BuildFixtureWith("granitemoe", [](Json& c) { c["model_type"] = "granitemoeshared"; }).ok());
  // A shared expert the config announces must be in the checkpoint.
  ExpectBuildError(BuildFixtureWith("granitemoe",
                                    [](Json& c) {
                                      c["model_type"] = "granitemoeshared";
                                      c["shared_intermediate_size"] = 32;
                                    }),
                   "shared_mlp.input_linear.weight");
}

// Expert counts: num_experts_per_tok within num_local_experts, and the checkpoint holding
// exactly the config's experts (Mixtral's per-expert tensors, GraniteMoE's 3-D ones) and
// shared expert (Qwen2-MoE).
TEST(ModelConfigTest, MixtureOfExpertsCountsMatchTheConfigAndTheCheckpoint) {
  for (const char* family : {"mixtral", "granitemoe"}) {
    EXPECT_TRUE(BuildFixtureWith(family, [](Json&) {}).ok()) << family;
    ExpectBuildError(BuildFixtureWith(family, [](Json& c) { c["num_experts_per_tok"] = 5; }),
                     "config.json: num_experts_per_tok = 5 with num_local_experts = 4");
    ExpectBuildError(BuildFixtureWith(family, [](Json& c) { c["num_experts_per_tok"] = 0; }),
                     "expected 1 <= num_experts_per_tok <= num_local_experts");
    ExpectBuildError(BuildFixtureWith(family, [](Json& c) { c.erase("num_local_experts"); }),
                     "num_local_experts");
  }
  ExpectBuildError(BuildFixtureWith("mixtral", [](Json& c) { c["num_local_experts"] = 5; }),
                   "model.layers.0.block_sparse_moe.experts.4.w1.weight");
  // Qwen2-MoE names the count num_experts, and keeps no dense layer here.
  EXPECT_TRUE(BuildFixtureWith("qwen2_moe", [](Json&) {}).ok());
  ExpectBuildError(BuildFixtureWith("qwen2_moe", [](Json& c) { c["num_experts_per_tok"] = 5; }),
                   "config.json: num_experts_per_tok = 5 with num_experts = 4");
  ExpectBuildError(BuildFixtureWith("qwen2_moe", [](Json& c) { c["decoder_sparse_step"] = 2; }),
                   "config.json: decoder_sparse_step = 2: dense MLP layers");
  ExpectBuildError(BuildFixtureWith("qwen2_moe", [](Json& c) { c["mlp_only_layers"] = {1}; }),
                   "config.json: mlp_only_layers = [1]: dense MLP layers");
  ExpectBuildError(
      BuildFixtureWith("qwen2_moe", [](Json& c) { c["shared_expert_intermediate_size"] = 97; }),
      "model.layers.0.mlp.shared_expert.gate_proj.weight");
  // Qwen3-MoE: Qwen2-MoE's names and rules without a shared expert; its routing follows
  // norm_topk_prob; a Qwen2-MoE checkpoint called qwen3_moe leaves its shared expert unread.
  auto qwen3_moe = FixtureSpecWith("qwen3_moe", [](Json&) {});
  ASSERT_TRUE(qwen3_moe.ok()) << qwen3_moe.status();
  EXPECT_EQ(qwen3_moe->shared_expert_intermediate, 0);
  EXPECT_EQ(qwen3_moe->routing, tgis::server::ExpertRouting::kSoftmaxTopKRenormalized);
  auto plain_topk = FixtureSpecWith("qwen3_moe", [](Json& c) { c["norm_topk_prob"] = false; });
  ASSERT_TRUE(plain_topk.ok()) << plain_topk.status();
  EXPECT_EQ(plain_topk->routing, tgis::server::ExpertRouting::kSoftmaxTopK);
  ExpectBuildError(BuildFixtureWith("qwen3_moe", [](Json& c) { c["num_experts_per_tok"] = 5; }),
                   "config.json: num_experts_per_tok = 5 with num_experts = 4");
  ExpectBuildError(BuildFixtureWith("qwen3_moe", [](Json& c) { c["decoder_sparse_step"] = 2; }),
                   "config.json: decoder_sparse_step = 2: dense MLP layers");
  ExpectBuildError(BuildFixtureWith("qwen3_moe", [](Json& c) { c["moe_intermediate_size"] = 0; }),
                   "config.json: moe_intermediate_size must be positive");
  ExpectBuildError(BuildFixtureWith("qwen2_moe",
                                    [](Json& c) {
                                      c["model_type"] = "qwen3_moe";
                                      c["head_dim"] = 16;
                                    }),
                   "model.layers.0.self_attn.q_norm.weight");
  for (int experts : {3, 5}) {
    ExpectBuildError(
        BuildFixtureWith("granitemoe", [&](Json& c) { c["num_local_experts"] = experts; }),
        "model.layers.0.block_sparse_moe.input_linear.weight: expected a 3-D tensor [experts, "
        "rows, columns] (biases: [experts, n]) of the config's " +
            std::to_string(experts) + " experts");
  }
}

// Cohere: Command R+'s per-head q/k norms are refused by key; logit_scale is a finite,
// non-zero number.
TEST(ModelConfigTest, CohereRefusesQkNormsAndChecksTheLogitScale) {
  EXPECT_TRUE(BuildFixtureWith("cohere", [](Json&) {}).ok());
  ExpectBuildError(BuildFixtureWith("cohere", [](Json& c) { c["use_qk_norm"] = true; }),
                   "config.json: use_qk_norm = true: per-head q and k LayerNorms");
  ExpectBuildError(BuildFixtureWith("cohere", [](Json& c) { c["logit_scale"] = 0.0; }),
                   "config.json: logit_scale = 0: expected a finite, non-zero number");
}

// Gemma 2: keys absent from config.json take Gemma2Config's defaults (soft caps 50 and 30,
// query_pre_attn_scalar 256, a window of 4096 on the even layers unless layer_types says
// otherwise, head_dim 256); a null soft
// cap is none; a cap or scalar that is not positive is refused by key; the MLP's activation is
// hidden_activation's (hidden_act only warns).
TEST(ModelConfigTest, Gemma2KeysTakeTheConfigClassDefaults) {
  auto spec = FixtureSpecWith("gemma2", [](Json&) {});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->residual, tgis::server::Residual::kSandwich);
  EXPECT_FLOAT_EQ(spec->attn_scale, 0.25f);  // the fixture's query_pre_attn_scalar: 16
  EXPECT_EQ(spec->layer_windows, (std::vector<int>{8, 0}));
  EXPECT_EQ(spec->head_dim, 24);
  auto defaults = FixtureSpecWith("gemma2", [](Json& c) {
    for (const char* key : {"attn_logit_softcapping", "final_logit_softcapping",
                            "query_pre_attn_scalar", "sliding_window"}) {
      c.erase(key);
    }
  });
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_EQ(defaults->attn_softcap, 50.0f);
  EXPECT_EQ(defaults->final_logit_softcap, 30.0f);
  EXPECT_FLOAT_EQ(defaults->attn_scale, 1.0f / 16);
  EXPECT_EQ(defaults->layer_windows, (std::vector<int>{4096, 0}));
  // transformers >= 4.53 saves layer_types; where it says otherwise than the even-layers rule,
  // it decides.
  auto typed = FixtureSpecWith("gemma2", [](Json& c) {
    c["layer_types"] = Json::array({"full_attention", "sliding_attention"});
  });
  ASSERT_TRUE(typed.ok()) << typed.status();
  EXPECT_EQ(typed->layer_windows, (std::vector<int>{0, 8}));
  ExpectBuildError(BuildFixtureWith("gemma2", [](Json& c) { c["layer_types"] = Json::array(); }),
                   "config.json: layer_types: expected a list of 2 layer types");
  // Without head_dim the checkpoint's [96, 64] q_proj no longer fits 4 heads of 256.
  ExpectBuildError(BuildFixtureWith("gemma2", [](Json& c) { c.erase("head_dim"); }),
                   "model.layers.0.self_attn.q_proj.weight: rows [0, 1024) of 96 do not exist");
  auto uncapped = FixtureSpecWith("gemma2", [](Json& c) {
    c["attn_logit_softcapping"] = nullptr;
    c["final_logit_softcapping"] = nullptr;
  });
  ASSERT_TRUE(uncapped.ok()) << uncapped.status();
  EXPECT_EQ(uncapped->attn_softcap, 0.0f);
  EXPECT_EQ(uncapped->final_logit_softcap, 0.0f);
  ExpectBuildError(
      BuildFixtureWith("gemma2", [](Json& c) { c["final_logit_softcapping"] = -30.0; }),
      "config.json: final_logit_softcapping = -30: expected null or a positive, finite number");
  ExpectBuildError(BuildFixtureWith("gemma2", [](Json& c) { c["query_pre_attn_scalar"] = 0; }),
                   "config.json: query_pre_attn_scalar = 0: expected a positive number");
  ExpectBuildError(
      BuildFixtureWith("gemma2", [](Json& c) { c["hidden_activation"] = "quick_gelu"; }),
      "config.json: hidden_activation = \"quick_gelu\" is not supported");
  EXPECT_TRUE(BuildFixtureWith("gemma2", [](Json& c) { c["hidden_act"] = "quick_gelu"; }).ok());
}

// Qwen3: q/k norms read per layer; each layer's window as transformers derives it (layer_types
// when config.json has it, else the layers from max_window_layers on, and only with
// use_sliding_window); head_dim Qwen3Config's 128 when absent.
TEST(ModelConfigTest, Qwen3WindowsFollowLayerTypesAndHeadNormsAreRead) {
  auto spec = FixtureSpecWith("qwen3", [](Json&) {});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(spec->qk_norms);
  EXPECT_EQ(spec->head_dim, 24);
  EXPECT_EQ(spec->layer_windows, (std::vector<int>{0, 8}));
  const std::vector<std::pair<std::function<void(Json&)>, std::vector<int>>> cases = {
      {[](Json& c) {
         c["layer_types"] = {"sliding_attention", "full_attention"};
       },
       {8, 0}},
      {[](Json& c) { c["use_sliding_window"] = false; }, {0, 0}},
      {[](Json& c) { c["sliding_window"] = nullptr; }, {0, 0}},
      {[](Json& c) { c.erase("layer_types"); }, {0, 8}},
      {[](Json& c) {
         c.erase("layer_types");
         c["max_window_layers"] = 0;
       },
       {8, 8}},
      {[](Json& c) {
         c.erase("layer_types");
         c.erase("max_window_layers");  // 28: no layer of 2
       },
       {0, 0}},
  };
  for (const auto& [edit, windows] : cases) {
    auto s = FixtureSpecWith("qwen3", edit);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->layer_windows, windows);
  }
  ExpectBuildError(
      BuildFixtureWith("qwen3", [](Json& c) { c["layer_types"][1] = "chunked_attention"; }),
      "config.json: layer_types[1] = \"chunked_attention\": expected \"full_attention\" or "
      "\"sliding_attention\"");
  ExpectBuildError(
      BuildFixtureWith("qwen3", [](Json& c) { c["layer_types"] = {"full_attention"}; }),
      "config.json: layer_types: expected a list of 2 layer types");
  ExpectBuildError(BuildFixtureWith("qwen3", [](Json& c) { c.erase("head_dim"); }),
                   "model.layers.0.self_attn.q_proj.weight: rows [0, 512) of 96 do not exist");
  // Qwen3-MoE: with use_sliding_window the window is on every layer (4.55's rule).
  auto moe = FixtureSpecWith("qwen3_moe", [](Json&) {});
  ASSERT_TRUE(moe.ok()) << moe.status();
  EXPECT_TRUE(moe->qk_norms);
  EXPECT_EQ(moe->layer_windows, (std::vector<int>{8, 8}));
  auto moe_full = FixtureSpecWith("qwen3_moe", [](Json& c) { c["use_sliding_window"] = false; });
  ASSERT_TRUE(moe_full.ok()) << moe_full.status();
  EXPECT_EQ(moe_full->layer_windows, (std::vector<int>{0, 0}));
  // A Qwen2 checkpoint called qwen3 has no q/k norms.
  ExpectBuildError(BuildFixtureWith("qwen2",
                                    [](Json& c) {
                                      c["model_type"] = "qwen3";
                                      c["head_dim"] = 16;
                                    }),
                   "model.layers.0.self_attn.q_norm.weight");
}

// Gemma 3 (text): windows by layer_types, else Gemma3TextConfig's sliding_window_pattern rule;
// the windowed layers' rotary from rope_local_base_freq unscaled, the others' from rope_theta
// with rope_scaling; (1 + w) q/k norms; what transformers would not do is refused by key.
TEST(ModelConfigTest, Gemma3WindowsAndRotaryBasesFollowTheLayerTypes) {
  auto spec = FixtureSpecWith("gemma3_text", [](Json&) {});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(spec->qk_norms);
  EXPECT_EQ(spec->residual, tgis::server::Residual::kSandwich);
  EXPECT_EQ(spec->layer_windows, (std::vector<int>{8, 0}));
  EXPECT_FLOAT_EQ(spec->final_logit_softcap, 8.0f);
  EXPECT_EQ(spec->attn_softcap, 0.0f);
  EXPECT_FLOAT_EQ(spec->attn_scale, 0.25f);  // query_pre_attn_scalar 16
  // max_position_embeddings is the scaled context already (linear x2 here; a Llama's would
  // serve twice it).
  EXPECT_EQ(spec->ServedPositions(256), 256);
  ASSERT_TRUE(spec->sliding_rotary.has_value());
  // Layer 0 rotates with base 10000 unscaled, layer 1 with 1e6 and linear x2.
  EXPECT_EQ(spec->RotaryOf(0).inv_freq, tgis::kernels::RotaryInvFreq(24, 10000.0));
  std::vector<float> global = tgis::kernels::RotaryInvFreq(24, 1e6);
  for (float& f : global) f /= 2;
  ASSERT_EQ(spec->RotaryOf(1).inv_freq.size(), global.size());
  for (size_t i = 0; i < global.size(); ++i)
    EXPECT_FLOAT_EQ(spec->RotaryOf(1).inv_freq[i], global[i]) << i;
  const std::vector<std::pair<std::function<void(Json&)>, std::vector<int>>> cases = {
      {[](Json& c) {
         c["layer_types"] = {"full_attention", "sliding_attention"};
       },
       {0, 8}},
      {[](Json& c) { c.erase("layer_types"); }, {8, 8}},  // the default pattern, 6
      {[](Json& c) {
         c.erase("layer_types");
         c["sliding_window_pattern"] = 2;
       },
       {8, 0}},
      {[](Json& c) {
         c.erase("layer_types");
         c["sliding_window_pattern"] = 1;
       },
       {0, 0}},
      {[](Json& c) {
         c.erase("sliding_window");  // 4096
       },
       {4096, 0}},
  };
  for (const auto& [edit, windows] : cases) {
    auto s = FixtureSpecWith("gemma3_text", edit);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(s->layer_windows, windows);
  }
  auto local = FixtureSpecWith("gemma3_text", [](Json& c) { c["rope_local_base_freq"] = 500.0; });
  ASSERT_TRUE(local.ok()) << local.status();
  EXPECT_EQ(local->RotaryOf(0).inv_freq, tgis::kernels::RotaryInvFreq(24, 500.0));
  ExpectBuildError(BuildFixtureWith("gemma3_text", [](Json& c) { c["sliding_window"] = nullptr; }),
                   "config.json: sliding_window = null");
  ExpectBuildError(
      BuildFixtureWith("gemma3_text", [](Json& c) { c["attn_logit_softcapping"] = 50.0; }),
      "config.json: attn_logit_softcapping = 50: transformers' Gemma 3 does not apply it");
  ExpectBuildError(
      BuildFixtureWith("gemma3_text", [](Json& c) { c["use_bidirectional_attention"] = true; }),
      "config.json: use_bidirectional_attention = true: an embedding model");
  ExpectBuildError(BuildFixtureWith("gemma3_text",
                                    [](Json& c) {
                                      c["rope_scaling"] = {
                                          {"rope_type", "yarn"},
                                          {"factor", 2.0},
                                          {"original_max_position_embeddings", 128}};
                                    }),
                   "config.json: rope_scaling: a rope type that scales attention");
  ExpectBuildError(
      BuildFixtureWith("gemma3_text", [](Json& c) { c["rope_local_base_freq"] = 0.0; }),
      "config.json: rope_local_base_freq = 0: expected a positive number");
  ExpectBuildError(BuildFixtureWith("gemma3_text",
                                    [](Json& c) {
                                      c.erase("layer_types");
                                      c["sliding_window_pattern"] = 0;
                                    }),
                   "config.json: sliding_window_pattern = 0: expected a positive number");
  // A Gemma 2 checkpoint called gemma3_text has no q/k norms.
  ExpectBuildError(BuildFixtureWith("gemma2",
                                    [](Json& c) {
                                      c["model_type"] = "gemma3_text";
                                      c["attn_logit_softcapping"] = nullptr;
                                    }),
                   "model.layers.0.self_attn.q_norm.weight");
}

// Tensors whose names start with `from` renamed to start with `to` instead.
std::function<void(Json&)> RenamePrefix(const std::string& from, const std::string& to) {
  return [=](Json& header) {
    Json renamed = Json::object();
    for (auto& [name, t] : header.items()) {
      const bool match = name.compare(0, from.size(), from) == 0;
      renamed[match ? to + name.substr(from.size()) : name] = t;
    }
    header = renamed;
  };
}

// A multimodal Gemma 3 checkpoint (model_type gemma3) is served as its language model:
// text_config over Gemma3TextConfig's defaults (the fixture's leaves rope_theta and
// rms_norm_eps out, as the released configs leave out what is the default), its tensors under
// the released checkpoints' names or 4.52's, the vision tower's unread; anything else is an
// error that names it.
TEST(ModelConfigTest, Gemma3CheckpointsServeTheirLanguageModel) {
  auto spec = FixtureSpecWith("gemma3", [](Json&) {});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(spec->qk_norms);
  EXPECT_EQ(spec->layer_windows, (std::vector<int>{8, 0}));  // sliding_window_pattern 2
  EXPECT_FLOAT_EQ(spec->norm_eps, 1e-6f);
  EXPECT_EQ(spec->final_logit_softcap, 0.0f);
  EXPECT_EQ(spec->RotaryOf(0).inv_freq, tgis::kernels::RotaryInvFreq(24, 10000.0));
  std::vector<float> global = tgis::kernels::RotaryInvFreq(24, 1e6);  // the default rope_theta
  for (float& f : global) f /= 2;
  ASSERT_EQ(spec->RotaryOf(1).inv_freq.size(), global.size());
  for (size_t i = 0; i < global.size(); ++i)
    EXPECT_FLOAT_EQ(spec->RotaryOf(1).inv_freq[i], global[i]) << i;
  // transformers >= 4.52's names.
  auto newer = FixtureSpecWith(
      "gemma3", [](Json&) {},
      [](Json& h) {
        RenamePrefix("language_model.model.", "model.language_model.")(h);
        RenamePrefix("vision_tower.", "model.vision_tower.")(h);
        RenamePrefix("multi_modal_projector.", "model.multi_modal_projector.")(h);
      });
  ASSERT_TRUE(newer.ok()) << newer.status();
  EXPECT_EQ(newer->layer_windows, spec->layer_windows);
  ExpectBuildError(
      FixtureSpecWith(
          "gemma3", [](Json&) {}, RenamePrefix("multi_modal_projector.", "audio_tower."))
          .status(),
      "does not use (a layout or config this server does not read): audio_tower.");
  ExpectBuildError(BuildFixtureWith("gemma3", [](Json& c) { c.erase("text_config"); }),
                   "config.json: text_config: expected the language model's config");
  ExpectBuildError(
      BuildFixtureWith("gemma3", [](Json& c) { c["text_config"]["model_type"] = "gemma2"; }),
      "config.json: text_config.model_type = \"gemma2\": expected \"gemma3_text\" in a gemma3 "
      "checkpoint");
  ExpectBuildError(
      BuildFixtureWith("gemma3",
                       [](Json& c) { c["text_config"]["final_logit_softcapping"] = 30.0; }),
      "config.json: text_config.final_logit_softcapping = 30: transformers' "
      "Gemma3ForConditionalGeneration does not apply it");
  // The top level's token ids apply where text_config has none, under text_config's.
  char tmpl[] = "/tmp/tgis-config-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  Json c = Json::parse(ReadAll(fs::path(TGIS_FIXTURES_DIR) / "models/gemma3/config.json"));
  c["text_config"].erase("eos_token_id");
  c["eos_token_id"] = Json::array({2, 7});
  c["bos_token_id"] = 5;  // text_config's 1 wins
  std::ofstream(fs::path(tmpl) / "config.json") << c.dump();
  auto config = tgis::server::ModelRegistry::Get().LoadConfig(tmpl);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->model_type, "gemma3_text");
  EXPECT_EQ(config->eos_token_ids, (std::vector<int32_t>{2, 7}));
  EXPECT_EQ(config->bos_token_id, 1);
  EXPECT_EQ(config->vocab_size, 1500);
  EXPECT_TRUE(config->tie_word_embeddings);  // Gemma3TextConfig's default
  fs::remove_all(tmpl);
}

// OLMo 2: norms on the sublayers' outputs only, q/k norms over the whole projections,
// Olmo2Config's rms_norm_eps 1e-5 when absent; a k norm over all KV heads cannot be split
// between ranks that share a KV head.
TEST(ModelConfigTest, Olmo2NormsTheOutputsAndTheWholeProjections) {
  auto spec = FixtureSpecWith("olmo2", [](Json&) {});
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->residual, tgis::server::Residual::kOutputNorms);
  EXPECT_TRUE(spec->qk_norms && spec->qk_norms_whole);
  EXPECT_FLOAT_EQ(spec->norm_eps, 1e-6f);
  auto defaults = FixtureSpecWith("olmo2", [](Json& c) { c.erase("rms_norm_eps"); });
  ASSERT_TRUE(defaults.ok()) << defaults.status();
  EXPECT_FLOAT_EQ(defaults->norm_eps, 1e-5f);
  // An OLMo (1) checkpoint called olmo2 has neither.
  ExpectBuildError(BuildFixtureWith("olmo", [](Json& c) { c["model_type"] = "olmo2"; }),
                   "model.layers.0.self_attn.q_norm.weight");
  // 4 ranks over 2 KV heads: each KV head on two ranks.
  tgis::server::DecoderSpec shared = *spec;
  shared.num_layers = 0;
  auto layout = tgis::server::ShardLayout::Make(shared, 0, 4);
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_TRUE(layout->kv_replicated);
  ExpectBuildError(tgis::server::ValidateWeights(shared, *layout, {}),
                   "a k norm over all KV heads (OLMo 2) with tensor parallelism over more ranks "
                   "(4) than KV heads (2) is not supported");
}

// StableLM: rotary on partial_rotary_factor of each head, StableLmConfig's 0.25 when absent;
// per-head q/k LayerNorms refused by key; with use_parallel_residual a checkpoint's
// post_attention_layernorm is a tensor that the model does not use, an error that names it.
TEST(ModelConfigTest, StableLmPartialRotaryAndResidualLayout) {
  auto spec = FixtureSpecWith("stablelm", [](Json& c) { c.erase("partial_rotary_factor"); });
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->rotary.rotary_dim, 4);  // a quarter of head_dim 16
  EXPECT_EQ(spec->residual, tgis::server::Residual::kSequential);
  ExpectBuildError(BuildFixtureWith("stablelm", [](Json& c) { c["qk_layernorm"] = true; }),
                   "config.json: qk_layernorm = true: per-head q and k LayerNorms");
  ExpectBuildError(BuildFixtureWith("stablelm", [](Json& c) { c["use_parallel_residual"] = true; }),
                   "model.layers.0.post_attention_layernorm.bias");
}

// Phi: qk_layernorm refused by key; partial_rotary_factor PhiConfig's 0.5 when absent.
TEST(ModelConfigTest, PhiRefusesQkNormsAndRotatesHalfByDefault) {
  auto spec = FixtureSpecWith("phi", [](Json& c) { c.erase("partial_rotary_factor"); });
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->rotary.rotary_dim, 8);  // half of head_dim 16
  EXPECT_EQ(spec->residual, tgis::server::Residual::kParallel);
  ExpectBuildError(BuildFixtureWith("phi", [](Json& c) { c["qk_layernorm"] = true; }),
                   "config.json: qk_layernorm = true: per-head q and k LayerNorms");
}

// OLMo: clip_qkv null is no clamp, a negative one is refused by key; its weightless norms
// take eps 1e-5 whatever the config holds.
TEST(ModelConfigTest, OlmoClipQkvAndFixedNormEps) {
  auto spec = FixtureSpecWith("olmo", [](Json& c) { c["layer_norm_eps"] = 0.5; });
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->clip_qkv, 1.5f);
  EXPECT_EQ(spec->norm_eps, 1e-5f);
  auto unclipped = FixtureSpecWith("olmo", [](Json& c) { c["clip_qkv"] = nullptr; });
  ASSERT_TRUE(unclipped.ok()) << unclipped.status();
  EXPECT_EQ(unclipped->clip_qkv, 0.0f);
  ExpectBuildError(BuildFixtureWith("olmo", [](Json& c) { c["clip_qkv"] = -1.0; }),
                   "config.json: clip_qkv = -1: expected null or a positive number");
}

// The Llama layout's MLP takes ACT2FN[hidden_act], as transformers' does: a Llama with "gelu"
// builds; a name we have no kernel for is refused by name.
TEST(ModelConfigTest, LlamaLayoutActivationIsHiddenAct) {
  EXPECT_TRUE(BuildFixtureWith("llama", [](Json& c) { c["hidden_act"] = "gelu"; }).ok());
  ExpectBuildError(BuildFixtureWith("gemma", [](Json& c) { c["hidden_act"] = "quick_gelu"; }),
                   "config.json: hidden_act = \"quick_gelu\" is not supported");
  // Gemma's hidden_activation is transformers' to ignore (a warning), not an error.
  EXPECT_TRUE(BuildFixtureWith("gemma", [](Json& c) { c["hidden_activation"] = "gelu"; }).ok());
}

TEST(ModelConfigTest, AnUnknownFamilyWithoutSizesSaysWhichKeysItLooked) {
  char tmpl[] = "/tmp/tgis-config-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const fs::path dir = tmpl;
  std::ofstream(dir / "config.json") << R"({"model_type": "mystery", "vocab_size": 100})";
  auto c = tgis::server::ModelConfig::Load(dir.string());
  fs::remove_all(dir);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("hidden_size, n_embd, d_model"), std::string::npos)
      << c.status();
  EXPECT_NE(c.status().message().find("'mystery'"), std::string::npos) << c.status();
}

}  // namespace

namespace {

// Hostile safetensors headers and config values: each fails the load with a message naming the
// file, the tensor or key and what is wrong; none aborts the process.
class HostileCheckpointTest : public LoaderTest {
 protected:
  absl::Status OpenWithTensor(const Json& entry) {
    header_["model.layers.0.extra.weight"] = entry;
    Save();
    auto w = tgis::server::WeightStore::Open(dir_.string());
    return w.status();
  }
};

TEST_F(HostileCheckpointTest, WronglyTypedHeaderFieldsAreNamed) {
  const uint64_t end = data_.size();
  struct Case {
    Json entry;
    const char* message;
  };
  const std::vector<Case> cases = {
      {{{"dtype", 5}, {"shape", {4}}, {"data_offsets", {0, 16}}}, "dtype 5 is not a string"},
      {{{"dtype", "F32"}, {"shape", {"a", 64}}, {"data_offsets", {0, 16}}},
       "is not a list of non-negative integers"},
      {{{"dtype", "F32"}, {"shape", {-1, 64}}, {"data_offsets", {0, 16}}},
       "is not a list of non-negative integers"},
      {{{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {"0", "16"}}},
       "is not a pair of non-negative integers"},
      {{{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {0}}},
       "is not a pair of non-negative integers"},
      {{{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {16, 0}}}, "end before they begin"},
      {{{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {end, end + 16}}},
       "(a truncated file?)"},
      {{{"dtype", "F32"}, {"shape", {5}}, {"data_offsets", {0, 16}}},
       "span 16 bytes; shape [5] of F32 needs 20"},
      {{{"dtype", "F32"},
        {"shape", {uint64_t{1} << 62, uint64_t{1} << 62}},
        {"data_offsets", {0, 16}}},
       "needs more"},
  };
  for (const Case& c : cases) {
    const absl::Status st = OpenWithTensor(c.entry);
    ASSERT_FALSE(st.ok()) << c.entry.dump();
    EXPECT_NE(st.message().find(c.message), std::string::npos) << st << " for " << c.entry.dump();
    EXPECT_NE(st.message().find("model.layers.0.extra.weight"), std::string::npos) << st;
    EXPECT_NE(st.message().find("model.safetensors"), std::string::npos) << st;
  }
}

// safetensors' own reader refuses these (its Metadata::validate): the tensors' bytes must tile
// the data exactly.
TEST_F(HostileCheckpointTest, HolesOverlapsAndTrailingBytesAreRefused) {
  const uint64_t end = data_.size();
  // A tensor over bytes another one holds.
  absl::Status st = OpenWithTensor({{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {0, 16}}});
  EXPECT_NE(st.message().find("overlap the tensors before"), std::string::npos) << st;
  EXPECT_NE(st.message().find("model.safetensors"), std::string::npos) << st;
  // A tensor 16 bytes past the others' end.
  data_.append(32, '\0');
  st = OpenWithTensor({{"dtype", "F32"}, {"shape", {4}}, {"data_offsets", {end + 16, end + 32}}});
  EXPECT_NE(st.message().find("leave a hole after the tensors before, which end at byte " +
                              std::to_string(end)),
            std::string::npos)
      << st;
  EXPECT_NE(st.message().find("model.layers.0.extra.weight"), std::string::npos) << st;
  // Bytes no tensor claims.
  header_.erase("model.layers.0.extra.weight");
  Save();
  st = tgis::server::WeightStore::Open(dir_.string()).status();
  EXPECT_NE(st.message().find(absl::StrCat("cover ", end, " bytes of the ", end + 32)),
            std::string::npos)
      << st;
  // The same bytes claimed: it opens.
  st = OpenWithTensor({{"dtype", "F32"}, {"shape", {8}}, {"data_offsets", {end, end + 32}}});
  EXPECT_TRUE(st.ok()) << st;
}

// The header's other rules in safetensors' reader: __metadata__ maps strings to strings, and a
// header is at most 100 MB.
TEST_F(HostileCheckpointTest, MetadataOtherThanTextAndOversizedHeadersAreRefused) {
  header_["__metadata__"] = {{"format", "pt"}, {"step", 3}};
  Save();
  absl::Status st = tgis::server::WeightStore::Open(dir_.string()).status();
  EXPECT_NE(st.message().find("is not a map of strings to strings"), std::string::npos) << st;
  header_["__metadata__"] = {{"format", "pt"}, {"step", "3"}};
  Save();
  EXPECT_TRUE(tgis::server::WeightStore::Open(dir_.string()).ok());

  // A sparse file: the length alone is refused, before anything is read.
  const fs::path big = dir_ / "model.safetensors";
  {
    std::ofstream out(big, std::ios::binary | std::ios::trunc);
    const uint64_t n = 100'000'001;
    out.write(reinterpret_cast<const char*>(&n), 8);
  }
  fs::resize_file(big, 100'000'016);
  st = tgis::server::WeightStore::Open(dir_.string()).status();
  EXPECT_NE(st.message().find("a header of 100000001 bytes, over safetensors' limit"),
            std::string::npos)
      << st;
}

// Sharded checkpoints: each tensor once, in the file model.safetensors.index.json names.
TEST_F(HostileCheckpointTest, ShardsHoldEachTensorOnceWhereTheIndexSays) {
  std::vector<std::string> names;
  for (auto it = header_.begin(); it != header_.end(); ++it) {
    if (it.key() != "__metadata__") names.push_back(it.key());
  }
  ASSERT_GT(names.size(), 2u);
  // `file` holds `tensors`, packed in order.
  auto write_shard = [&](const std::string& file, const std::vector<std::string>& tensors) {
    Json h = Json::object();
    std::string bytes;
    for (const std::string& n : tensors) {
      const auto begin = header_[n]["data_offsets"][0].get<size_t>();
      const auto end = header_[n]["data_offsets"][1].get<size_t>();
      h[n] = header_[n];
      h[n]["data_offsets"] = {bytes.size(), bytes.size() + end - begin};
      bytes += data_.substr(begin, end - begin);
    }
    WriteSafetensors(dir_ / file, h, bytes);
  };
  const size_t half = names.size() / 2;
  const std::vector<std::string> first(names.begin(), names.begin() + half);
  const std::vector<std::string> second(names.begin() + half, names.end());
  fs::remove(dir_ / "model.safetensors");
  write_shard("model-00001-of-00002.safetensors", first);
  write_shard("model-00002-of-00002.safetensors", second);
  Json map = Json::object();
  for (const std::string& n : first) map[n] = "model-00001-of-00002.safetensors";
  for (const std::string& n : second) map[n] = "model-00002-of-00002.safetensors";
  auto write_index = [&] {
    std::ofstream(dir_ / "model.safetensors.index.json", std::ios::trunc)
        << Json({{"metadata", {{"total_size", data_.size()}}}, {"weight_map", map}}).dump();
  };
  write_index();
  EXPECT_TRUE(Build().ok()) << Build();

  // The index places a tensor in the other file.
  map[second[0]] = "model-00001-of-00002.safetensors";
  write_index();
  absl::Status st = tgis::server::WeightStore::Open(dir_.string()).status();
  EXPECT_NE(
      st.message().find("model-00002-of-00002.safetensors: tensor " + second[0] + " is here, but"),
      std::string::npos)
      << st;
  EXPECT_NE(st.message().find("places it in model-00001-of-00002.safetensors"), std::string::npos)
      << st;

  // A tensor in both files (no index: every *.safetensors file of the folder is read).
  fs::remove(dir_ / "model.safetensors.index.json");
  std::vector<std::string> first_and_one = first;
  first_and_one.push_back(second[0]);
  write_shard("model-00001-of-00002.safetensors", first_and_one);
  st = tgis::server::WeightStore::Open(dir_.string()).status();
  EXPECT_NE(st.message().find("tensor " + second[0] + " is in both"), std::string::npos) << st;
}

TEST_F(HostileCheckpointTest, WronglyTypedConfigValuesAreNamed) {
  struct Case {
    const char* key;
    Json value;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"tie_word_embeddings", "yes", "tie_word_embeddings = \"yes\" is not a boolean"},
      {"eos_token_id", int64_t{1000000000000}, "eos_token_id: 1000000000000 is not a token id"},
      {"eos_token_id", Json::array({2, "x"}), "eos_token_id: \"x\" is not a token id"},
      {"bos_token_id", 3.5, "bos_token_id: 3.5 is not a token id"},
      {"rms_norm_eps", "small", "rms_norm_eps = \"small\": wrong type"},
      {"rope_theta", Json::array({1}), "rope_theta = [1]: wrong type"},
  };
  const std::string original = ReadAll(dir_ / "config.json");
  for (const Case& c : cases) {
    std::ofstream(dir_ / "config.json", std::ios::trunc) << original;
    EditConfig([&](Json& j) { j[c.key] = c.value; });
    const absl::Status st = Build();
    ASSERT_FALSE(st.ok()) << c.key;
    EXPECT_NE(st.message().find(c.message), std::string::npos) << st;
  }
}

}  // namespace
