// Single-thread encode throughput of our tokenizer on a text file:
//   tokenizer_bench MODEL_DIR TEXT_FILE [REPEATS]
// Prints MB/s, tokens/s and the ids of the whole text (as JSON on the last line) so the
// Python driver (benchmarks/tokenizer_bench.py) can check them against the reference.
#include <chrono>
#include <fstream>
#include <iostream>
#include <sstream>

#include "tokenizer/sentencepiece.h"
#include "tokenizer/tokenizer.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: tokenizer_bench MODEL_DIR TEXT_FILE [REPEATS]\n";
    return 2;
  }
  const int repeats = argc > 3 ? std::atoi(argv[3]) : 3;
  tgis::EnableSentencePieceModels();
  auto tok = tgis::Tokenizer::FromDirectory(argv[1]);
  if (!tok.ok()) {
    std::cerr << tok.status() << "\n";
    return 1;
  }
  std::ifstream in(argv[2], std::ios::binary);
  std::stringstream buf;
  buf << in.rdbuf();
  const std::string text = buf.str();
  // Encode line by line, as a server sees many requests (and as the reference is driven).
  std::vector<std::string> lines;
  std::istringstream ls(text);
  for (std::string line; std::getline(ls, line);) lines.push_back(line);
  double best = 1e30;
  size_t tokens = 0;
  std::vector<int32_t> all_ids;
  for (int r = 0; r < repeats; ++r) {
    tokens = 0;
    auto t0 = std::chrono::steady_clock::now();
    for (const std::string& line : lines) {
      auto enc = (*tok)->Encode(line, false);
      if (!enc.ok()) {
        std::cerr << enc.status() << "\n";
        return 1;
      }
      tokens += enc->ids.size();
      if (r == 0) all_ids.insert(all_ids.end(), enc->ids.begin(), enc->ids.end());
    }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s);
  }
  std::cout << "seconds " << best << "\n";
  std::cout << "mb_per_s " << text.size() / best / 1e6 << "\n";
  std::cout << "tokens_per_s " << tokens / best << "\n";
  std::cout << "tokens " << tokens << "\n";
  std::cout << "ids";
  for (int32_t id : all_ids) std::cout << ' ' << id;
  std::cout << "\n";
  return 0;
}
