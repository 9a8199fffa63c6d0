// tgis-tokenizer: encode / decode / stream-decode lines of JSON from stdin with a model
// folder's tokenizer, printing one JSON object per line. For people debugging a tokenizer and
// for the oracle tests.
//
//   tgis-tokenizer encode MODEL_DIR [--no-special-tokens]   in: "text"   out:
//   {"ids","tokens","offsets"} tgis-tokenizer decode MODEL_DIR [--skip-special-tokens] in: [ids]
//   out: {"text"} tgis-tokenizer stream MODEL_DIR [--skip-special-tokens] in: [ids]    out:
//   {"pieces","text"}
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tokenizer/sentencepiece.h"
#include "tokenizer/tokenizer.h"

namespace {

using Json = nlohmann::json;

int Usage() {
  std::cerr << "usage: tgis-tokenizer {encode|decode|stream} MODEL_DIR "
               "[--no-special-tokens] [--skip-special-tokens]\n"
               "Reads one JSON value per line from stdin (a string to encode, or an array of ids\n"
               "to decode) and writes one JSON object per line.\n";
  return 2;
}

void Emit(const Json& j) {
  std::cout << j.dump(-1, ' ', false, Json::error_handler_t::replace) << '\n';
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return Usage();
  const std::string mode = argv[1];
  const std::string dir = argv[2];
  bool add_special = true, skip_special = false;
  for (int i = 3; i < argc; ++i) {
    if (std::strcmp(argv[i], "--no-special-tokens") == 0) {
      add_special = false;
    } else if (std::strcmp(argv[i], "--skip-special-tokens") == 0) {
      skip_special = true;
    } else {
      return Usage();
    }
  }
  if (mode != "encode" && mode != "decode" && mode != "stream") return Usage();
  tgis::EnableSentencePieceModels();
  auto tok = tgis::Tokenizer::FromDirectory(dir);
  if (!tok.ok()) {
    std::cerr << "tgis-tokenizer: " << tok.status().message() << "\n";
    return 1;
  }
  std::ios::sync_with_stdio(false);
  std::string line;
  while (std::getline(std::cin, line)) {
    Json in = Json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (in.is_discarded()) {
      Emit({{"error", "input line is not valid JSON (or not valid UTF-8)"}});
      continue;
    }
    if (mode == "encode") {
      if (!in.is_string()) {
        Emit({{"error", "expected a JSON string"}});
        continue;
      }
      auto enc = (*tok)->Encode(in.get<std::string>(), add_special);
      if (!enc.ok()) {
        Emit({{"error", std::string(enc.status().message())}});
        continue;
      }
      Json offsets = Json::array();
      for (const auto& o : enc->offsets) offsets.push_back({o.start, o.end});
      Emit({{"ids", enc->ids}, {"tokens", enc->tokens}, {"offsets", offsets}});
      continue;
    }
    if (!in.is_array()) {
      Emit({{"error", "expected a JSON array of ids"}});
      continue;
    }
    std::vector<int32_t> ids;
    for (const Json& v : in) ids.push_back(v.is_number_integer() ? v.get<int32_t>() : -1);
    if (mode == "decode") {
      auto text = (*tok)->Decode(ids, skip_special);
      if (!text.ok()) {
        Emit({{"error", std::string(text.status().message())}});
      } else {
        Emit({{"text", *text}});
      }
      continue;
    }
    tgis::IncrementalDecoder dec(**tok, skip_special);
    Json pieces = Json::array();
    std::string all;
    bool failed = false;
    for (int32_t id : ids) {
      auto piece = dec.Next(id);
      if (!piece.ok()) {
        Emit({{"error", std::string(piece.status().message())}});
        failed = true;
        break;
      }
      if (!piece->empty()) pieces.push_back(*piece);
      all += *piece;
    }
    if (failed) continue;
    auto rest = dec.Flush();
    if (!rest.ok()) {
      Emit({{"error", std::string(rest.status().message())}});
      continue;
    }
    if (!rest->empty()) pieces.push_back(*rest);
    all += *rest;
    Emit({{"pieces", pieces}, {"text", all}});
  }
  return 0;
}
