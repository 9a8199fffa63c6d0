// A GenerationService request as it arrives, from its wire bytes: decoded (with the reason when
// it cannot be), its parameters converted and validated, each input tokenized (truncation
// included) and checked against the limits, and its stop sequences run over the input's text.
// The first byte picks the method (Generate, GenerateStream, Tokenize) and the tokenizer.
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "proto/generation.pb.h"
#include "router/input_encoding.h"
#include "router/request_decoding.h"
#include "router/stop_sequences.h"
#include "router/validation.h"
#include "tests/fuzz/fuzz_files.h"
#include "tokenizer/tokenizer.h"

namespace {

std::vector<std::unique_ptr<tgis::Tokenizer>>& Tokenizers() {
  static std::vector<std::unique_ptr<tgis::Tokenizer>> tokenizers;
  return tokenizers;
}

void Generate(const tgis::Tokenizer& tokenizer, const fmaas::Parameters* params,
              const std::vector<const std::string*>& texts) {
  using namespace tgis::router;
  ValidationLimits limits;
  limits.max_sequence_length = 64;  // small, so that inputs reach it
  limits.max_new_tokens = 32;
  auto converted = ConvertParameters(params, limits, Clock::now());
  if (!converted.ok()) return;
  for (const std::string* text : texts) {
    GenerationParams p = *converted;
    size_t raw_length = 0;
    auto encoding = EncodeInput(tokenizer, *text, p.truncate_input_tokens, &raw_length);
    if (!encoding.ok()) continue;
    if (!ValidateInput(static_cast<uint32_t>(encoding->ids.size()), 0, limits, 1234, &p).ok()) {
      continue;
    }
    // The stop sequences over the text decoded back, token by token, as generation would.
    StopSequenceMatcher matcher(p.stop_sequences, p.include_stop_sequence);
    tgis::IncrementalDecoder decoder(tokenizer, /*skip_special_tokens=*/true);
    for (int32_t id : encoding->ids) {
      auto piece = decoder.Next(id);
      if (!piece.ok()) break;
      if (matcher.Append(*piece, /*may_stop=*/true).match.has_value()) break;
    }
    (void)matcher.Flush();
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tgis::fuzz::QuietLogs();
  for (const char* name : {"gpt2", "llama2", "t5", "bloom", "unigram_hf", "llama3"}) {
    auto t = tgis::Tokenizer::FromDirectory(std::string(TGIS_FIXTURES_DIR) + "/tokenizers/" + name);
    if (t.ok()) Tokenizers().push_back(std::move(*t));
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0 || Tokenizers().empty()) return 0;
  const tgis::Tokenizer& tokenizer = *Tokenizers()[(data[0] / 3) % Tokenizers().size()];
  const std::string_view bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  switch (data[0] % 3) {
    case 0: {
      fmaas::BatchedGenerationRequest request;
      if (!tgis::router::DecodeRequest(bytes, &request).ok()) return 0;
      std::vector<const std::string*> texts;
      for (const auto& r : request.requests()) texts.push_back(&r.text());
      Generate(tokenizer, request.has_params() ? &request.params() : nullptr, texts);
      break;
    }
    case 1: {
      fmaas::SingleGenerationRequest request;
      if (!tgis::router::DecodeRequest(bytes, &request).ok()) return 0;
      Generate(tokenizer, request.has_params() ? &request.params() : nullptr,
               {&request.request().text()});
      break;
    }
    default: {
      fmaas::BatchedTokenizeRequest request;
      if (!tgis::router::DecodeRequest(bytes, &request).ok()) return 0;
      for (const auto& r : request.requests()) {
        (void)tgis::router::EncodeTail(tokenizer, r.text(), request.truncate_input_tokens());
      }
    }
  }
  return 0;
}
