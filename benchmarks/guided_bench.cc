// Guided decoding's costs at a real vocabulary's size: compiling each constraint (the router,
// once per distinct schema or pattern) and masking a step's logits (the shard, per guided
// sequence per step: a full walk of the vocabulary the first time a state is reached, a copy
// of the cached mask after). The vocabulary is synthetic (no tokenizer of that size is in the
// fixtures): every byte, then words, space-led words, digits, punctuation runs and multi-byte
// characters, with token lengths as a 128K byte-level BPE vocabulary has them (1-16 bytes).
//   guided_bench [--vocab N] [--steps N]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "grammar/grammar.h"
#include "server/guided_decoding.h"

namespace {

using Clock = std::chrono::steady_clock;
double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

std::vector<std::string> SyntheticVocabulary(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::string> vocab;
  for (int b = 0; b < 256; ++b) vocab.emplace_back(1, static_cast<char>(b));
  const char* letters = "etaoinshrdlcumwfgypbvkjxqz";
  const char* punct = "{}[]\":,.;!?()-_/\\'";
  const char* multi[] = {"é", "ü", "日", "本", "語", "中", "😀", "ä", "ß", "ñ"};
  std::geometric_distribution<int> len(0.25);
  std::uniform_int_distribution<int> kind(0, 99), pick(0, 1 << 30);
  while (vocab.size() < n) {
    std::string t;
    const int k = kind(rng), l = 1 + std::min(len(rng), 14);
    if (k < 45) t.push_back(' ');  // a word after a space
    if (k < 85) {
      for (int i = 0; i < l; ++i) t.push_back(letters[std::min(pick(rng) % 26, pick(rng) % 26)]);
    } else if (k < 90) {
      for (int i = 0; i < std::min(l, 4); ++i) t.push_back(static_cast<char>('0' + pick(rng) % 10));
    } else if (k < 96) {
      for (int i = 0; i < std::min(l, 3); ++i) t.push_back(punct[pick(rng) % std::strlen(punct)]);
    } else {
      for (int i = 0; i < std::min(l, 3); ++i) t += multi[pick(rng) % 10];
    }
    vocab.push_back(std::move(t));
  }
  vocab[2].clear();  // the EOS id: a special token, no bytes
  return vocab;
}

}  // namespace

int main(int argc, char** argv) {
  size_t vocab_size = 128256, steps = 400;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--vocab")) vocab_size = std::strtoul(argv[i + 1], nullptr, 10);
    if (!std::strcmp(argv[i], "--steps")) steps = std::strtoul(argv[i + 1], nullptr, 10);
  }
  auto vocab = std::make_shared<const tgis::server::GuidedVocabulary>(
      SyntheticVocabulary(vocab_size, 20261129));
  const std::string person =
      R"({"type":"object","properties":{"name":{"type":"string","maxLength":20},)"
      R"("age":{"type":"integer"},"tags":{"type":"array","items":{"type":"string"},"maxItems":3},)"
      R"("email":{"type":"string","format":"uuid"},"ok":{"type":"boolean"}},"required":["name","age"]})";
  struct Case {
    const char* name;
    absl::StatusOr<tgis::grammar::ByteDfa> (*compile)(const std::string&);
    std::string text;
  };
  const Case cases[] = {
      {"regex phone", [](const std::string& t) { return tgis::grammar::CompileRegex(t); },
       R"(\(\d{3}\) \d{3}-\d{4})"},
      {"choice x4",
       [](const std::string&) {
         return tgis::grammar::CompileChoices({"positive", "negative", "neutral", "mixed"});
       },
       ""},
      {"json_schema", [](const std::string& t) { return tgis::grammar::CompileJsonSchema(t); },
       person},
      {"format JSON", [](const std::string&) { return tgis::grammar::CompileJsonObject(); }, ""},
  };
  std::printf("vocabulary %zu tokens (synthetic), %zu steps per constraint\n", vocab->size(),
              steps);
  std::printf("%-12s %10s %7s %16s %16s %8s\n", "constraint", "compile ms", "states",
              "first ms/step", "repeat ms/step", "steps");
  std::mt19937_64 rng(1);
  std::normal_distribution<float> noise(0.0f, 2.0f);
  std::vector<float> logits(vocab->size());
  for (const Case& c : cases) {
    const auto t0 = Clock::now();
    auto dfa = c.compile(c.text);
    const auto t1 = Clock::now();
    if (!dfa.ok()) {
      std::printf("%s: %s\n", c.name, std::string(dfa.status().message()).c_str());
      return 1;
    }
    auto shared = std::make_shared<const tgis::grammar::ByteDfa>(*dfa);
    // Requests one after another (a new one at each EOS), masking random logits and taking the
    // best allowed token. "first": every request brings a new automaton, whose masks are
    // computed as its states are reached (the first request of a constraint); "repeat": the
    // requests share one (the shard's cache, for a constraint clients send again).
    double ms[2] = {0, 0};
    for (int shared_masks = 0; shared_masks < 2; ++shared_masks) {
      auto automaton = std::make_shared<tgis::server::GuidedAutomaton>(shared, vocab);
      auto next = [&] {
        if (!shared_masks)
          automaton = std::make_shared<tgis::server::GuidedAutomaton>(shared, vocab);
        return std::make_unique<tgis::server::TokenConstraint>(automaton, std::vector<int32_t>{2});
      };
      auto constraint = next();
      for (size_t step = 0; step < steps; ++step) {
        for (float& x : logits) x = noise(rng);
        const auto a = Clock::now();
        constraint->Mask(logits);
        ms[shared_masks] += Ms(a, Clock::now());
        size_t best = 0;
        for (size_t i = 1; i < logits.size(); ++i) best = logits[i] > logits[best] ? i : best;
        if (best == 2) {
          constraint = next();
        } else {
          constraint->Advance(static_cast<int32_t>(best));
        }
      }
    }
    std::printf("%-12s %10.1f %7d %16.3f %16.3f %8zu\n", c.name, Ms(t0, t1), shared->num_states(),
                ms[0] / steps, ms[1] / steps, steps);
  }
  return 0;
}
