// SentencePiece .model support (tokenizer.model / spiece.model without a tokenizer.json).
// It lives in its own library, tgis_tokenizer_sentencepiece: Debian's libsentencepiece carries
// and exports its own copy of protobuf, which clashes with the protobuf gRPC uses, so programs
// that speak gRPC (the router) read tokenizer.json only, as TGIS's router does.
#pragma once

namespace tgis {

// Lets Tokenizer::FromDirectory load SentencePiece .model files in this program.
void EnableSentencePieceModels();

}  // namespace tgis
