// tokenizer_config.json (special tokens by name or as AddedToken objects, add_bos_token /
// add_eos_token) beside a small tokenizer.json or a SentencePiece model, picked by the input's
// first byte.
#include <filesystem>
#include <string>

#include "tests/fuzz/fuzz_files.h"
#include "tests/fuzz/tokenizer_exercise.h"
#include "tokenizer/sentencepiece.h"
#include "tokenizer/tokenizer.h"

namespace {
std::string g_json_dir, g_spm_dir;
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tgis::fuzz::QuietLogs();
  tgis::EnableSentencePieceModels();
  namespace fs = std::filesystem;
  fs::create_directories(tgis::fuzz::ScratchDir() + "/json");
  fs::create_directories(tgis::fuzz::ScratchDir() + "/spm");
  // A small tokenizer.json (the seed corpus's, not a fixture's 150 kB vocabulary).
  tgis::fuzz::WriteScratch(
      "json/tokenizer.json",
      tgis::fuzz::ReadFile(std::string(TGIS_FUZZ_CORPUS_DIR) + "/tokenizer_json/llama2.json"));
  tgis::fuzz::CopyFixture("tokenizers/llama_spm/tokenizer.model", "spm/tokenizer.model");
  g_json_dir = tgis::fuzz::ScratchDir() + "/json";
  g_spm_dir = tgis::fuzz::ScratchDir() + "/spm";
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool spm = data[0] & 1;
  tgis::fuzz::WriteScratch(spm ? "spm/tokenizer_config.json" : "json/tokenizer_config.json",
                           data + 1, size - 1);
  auto tokenizer = tgis::Tokenizer::FromDirectory(spm ? g_spm_dir : g_json_dir);
  if (tokenizer.ok()) tgis::fuzz::Exercise(**tokenizer);
  return 0;
}
