// tokenizer.json (normalizers, pre-tokenizers, models, post-processors, decoders, added tokens)
// loaded from a model folder, then used as a request would use it: encode, decode, stream.
#include <string>

#include "tests/fuzz/fuzz_files.h"
#include "tests/fuzz/tokenizer_exercise.h"
#include "tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tgis::fuzz::QuietLogs();
  tgis::fuzz::CopyFixture("tokenizers/llama2/tokenizer_config.json", "tokenizer_config.json");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tgis::fuzz::WriteScratch("tokenizer.json", data, size);
  auto tokenizer = tgis::Tokenizer::FromDirectory(tgis::fuzz::ScratchDir());
  if (tokenizer.ok()) tgis::fuzz::Exercise(**tokenizer);
  return 0;
}
