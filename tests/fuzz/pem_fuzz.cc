// The TLS files the router reads at start: the first byte picks which of the server
// certificate, its key or the client CA is the input; the others are the seed corpus's valid
// files.
#include <string>

#include "router/tls_config.h"
#include "tests/fuzz/fuzz_files.h"

namespace {
std::string g_cert, g_key, g_ca;
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tgis::fuzz::QuietLogs();
  const std::string dir = std::string(TGIS_FUZZ_CORPUS_DIR) + "/pem/";
  g_cert = tgis::fuzz::WriteScratch("server.crt", tgis::fuzz::ReadFile(dir + "valid_cert"));
  g_key = tgis::fuzz::WriteScratch("server.key", tgis::fuzz::ReadFile(dir + "valid_key"));
  g_ca = tgis::fuzz::WriteScratch("ca.crt", tgis::fuzz::ReadFile(dir + "valid_ca"));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  tgis::router::TlsPaths paths{g_cert, g_key, g_ca};
  const std::string input = tgis::fuzz::WriteScratch("input.pem", data + 1, size - 1);
  switch (data[0] % 3) {
    case 0:
      paths.cert_path = input;
      break;
    case 1:
      paths.key_path = input;
      break;
    default:
      paths.client_ca_path = input;
  }
  (void)tgis::router::LoadTlsConfig(paths);
  return 0;
}
