#include "router/request_decoding.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/unknown_field_set.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "tokenizer/tokenizer.h"

namespace tgis::router {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::UnknownField;
using google::protobuf::UnknownFieldSet;

// Nesting deeper than this is refused as protobuf itself does (its default recursion limit).
constexpr int kMaxDepth = 100;

// The first problem in `fields` read as a `type` message, or nothing when none is found.
std::optional<std::string> FindProblem(const UnknownFieldSet& fields, const Descriptor& type,
                                       int depth) {
  if (depth > kMaxDepth) {
    return absl::StrCat(type.full_name(), " is nested more than ", kMaxDepth, " deep");
  }
  for (int i = 0; i < fields.field_count(); ++i) {
    const UnknownField& value = fields.field(i);
    const FieldDescriptor* field = type.FindFieldByNumber(value.number());
    // Unknown fields, and known ones sent with another wire type, are kept as unknown fields
    // by protobuf: never the reason a parse failed.
    if (field == nullptr || value.type() != UnknownField::TYPE_LENGTH_DELIMITED) continue;
    if (field->type() == FieldDescriptor::TYPE_STRING && !IsValidUtf8(value.length_delimited())) {
      return absl::StrCat("field ", field->full_name(), " is not valid UTF-8");
    }
    if (field->type() == FieldDescriptor::TYPE_MESSAGE) {
      UnknownFieldSet nested;
      if (!nested.ParseFromString(value.length_delimited())) {
        return absl::StrCat("field ", field->full_name(), " is not a valid ",
                            field->message_type()->full_name(), " message");
      }
      if (auto problem = FindProblem(nested, *field->message_type(), depth + 1)) return problem;
    }
  }
  return std::nullopt;
}

}  // namespace

absl::Status DecodeRequest(std::string_view bytes, google::protobuf::Message* message) {
  if (message->ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return absl::OkStatus();
  }
  const Descriptor& type = *message->GetDescriptor();
  UnknownFieldSet fields;
  std::optional<std::string> problem;
  if (!fields.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    problem = "the bytes are not a protobuf message";
  } else {
    problem = FindProblem(fields, type, 0);
  }
  return absl::InvalidArgumentError(absl::StrCat("the request could not be decoded as ",
                                                 type.full_name(), ": ",
                                                 problem.value_or("malformed protobuf")));
}

absl::Status DecodeRequest(const grpc::ByteBuffer& buffer, google::protobuf::Message* message) {
  std::vector<grpc::Slice> slices;
  if (!buffer.Dump(&slices).ok()) {
    return absl::InvalidArgumentError("the request's bytes could not be read");
  }
  if (slices.size() == 1) {
    return DecodeRequest(
        std::string_view(reinterpret_cast<const char*>(slices[0].begin()), slices[0].size()),
        message);
  }
  std::string bytes;
  bytes.reserve(buffer.Length());
  for (const grpc::Slice& s : slices)
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return DecodeRequest(bytes, message);
}

void EncodeResponse(const google::protobuf::Message& message, grpc::ByteBuffer* buffer) {
  grpc::Slice slice(message.SerializeAsString());
  *buffer = grpc::ByteBuffer(&slice, 1);
}

}  // namespace tgis::router
