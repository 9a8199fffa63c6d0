// TLS on the gRPC port, as TGIS configures it: TLS_CERT_PATH + TLS_KEY_PATH enable TLS;
// TLS_CLIENT_CA_CERT_PATH also requires client certificates that chain to that CA (mTLS).
// Everything is checked at start, so that a bad file fails the router with a message naming
// it rather than failing every handshake later.
#pragma once

#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace tgis::router {

struct TlsPaths {
  std::string cert_path;       // TLS_CERT_PATH
  std::string key_path;        // TLS_KEY_PATH
  std::string client_ca_path;  // TLS_CLIENT_CA_CERT_PATH
};

struct TlsConfig {
  std::string cert_chain_pem;  // the server certificate (and any intermediates)
  std::string private_key_pem;
  std::string client_ca_pem;  // empty: no client certificates asked for
  bool mutual() const { return !client_ca_pem.empty(); }
};

// No paths: std::nullopt (plaintext). Otherwise the files, read and checked: each must be
// readable and parse as PEM (certificates, or a private key), and the key must be the
// certificate's. Errors are INVALID_ARGUMENT or NOT_FOUND and name the file.
absl::StatusOr<std::optional<TlsConfig>> LoadTlsConfig(const TlsPaths& paths);

}  // namespace tgis::router
