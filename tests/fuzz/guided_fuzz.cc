// Guided decoding's compilers on a client's text (DecodingParameters regex, choice,
// json_schema, grammar): the first byte picks which; the rest is the pattern, the choices
// (separated by newlines), the schema or the GBNF grammar. A compiled automaton must be well formed
// and walk any bytes.
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "grammar/grammar.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  absl::StatusOr<tgis::grammar::ByteDfa> dfa;
  switch (data[0] % 4) {
    case 0:
      dfa = tgis::grammar::CompileRegex(text);
      break;
    case 1:
      dfa = tgis::grammar::CompileChoices(absl::StrSplit(text, '\n'));
      break;
    case 2:
      dfa = tgis::grammar::CompileJsonSchema(text);
      break;
    default:
      dfa = tgis::grammar::CompileGbnf(text);
  }
  if (!dfa.ok()) return 0;
  if (!dfa->Validate().ok()) __builtin_trap();
  int32_t state = 0;
  for (char c : text) {
    state = dfa->Step(state, static_cast<uint8_t>(c));
    if (state == tgis::grammar::ByteDfa::kDead) break;
    if (state < 0 || state >= dfa->num_states()) __builtin_trap();
  }
  return 0;
}
