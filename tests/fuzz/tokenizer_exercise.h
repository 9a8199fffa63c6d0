// What a request does with a tokenizer, for the fuzz targets that load one.
#pragma once

#include "tokenizer/tokenizer.h"

namespace tgis::fuzz {

// Encodes texts (plain, spaced, Unicode, special-token names, empty) with and without the
// special tokens, decodes the ids back both ways and streams them through IncrementalDecoder.
void Exercise(const Tokenizer& tokenizer);

}  // namespace tgis::fuzz
