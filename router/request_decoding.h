// Request messages from their wire bytes, so that a request gRPC could not parse gets
// INVALID_ARGUMENT naming what is wrong (gRPC C++ would answer it UNIMPLEMENTED, without a
// word, before any handler ran).
#pragma once

#include <google/protobuf/message.h>
#include <grpcpp/support/byte_buffer.h>

#include <string_view>

#include "absl/status/status.h"

namespace tgis::router {

// Parses `bytes` into `message`. On failure, INVALID_ARGUMENT saying why, as precisely as the
// bytes allow: the field (by its full name) whose string is not UTF-8, whose wire type is not
// its type's, or whose nested message is malformed; else that the bytes are not a protobuf
// message at all.
absl::Status DecodeRequest(std::string_view bytes, google::protobuf::Message* message);
// The same from a call's request as gRPC received it.
absl::Status DecodeRequest(const grpc::ByteBuffer& buffer, google::protobuf::Message* message);
// A response message as gRPC sends it.
void EncodeResponse(const google::protobuf::Message& message, grpc::ByteBuffer* buffer);

}  // namespace tgis::router
