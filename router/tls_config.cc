#include "router/tls_config.h"

#include <glog/logging.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"

namespace tgis::router {
namespace {

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using Bio = std::unique_ptr<BIO, BioFree>;
using Cert = std::unique_ptr<X509, X509Free>;
using Key = std::unique_ptr<EVP_PKEY, KeyFree>;

// "TLS certificate /path (TLS_CERT_PATH)": how every message names a file.
std::string Name(const char* what, const std::string& path, const char* env) {
  return absl::StrCat(what, " ", path, " (", env, ")");
}

// OpenSSL's reason for the last failure, and the error queue emptied.
std::string OpenSslReason() {
  const unsigned long e = ERR_peek_last_error();
  const char* reason = e != 0 ? ERR_reason_error_string(e) : nullptr;
  std::string out = reason != nullptr ? reason : "unknown error";
  ERR_clear_error();
  return out;
}

absl::StatusOr<std::string> ReadFile(const std::string& name, const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    return absl::NotFoundError(absl::StrCat(name, ": no such file"));
  }
  if (std::filesystem::is_directory(path, ec)) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": is a directory, not a PEM file"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": cannot be read: ", std::strerror(errno)));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": cannot be read: ", std::strerror(errno)));
  }
  return text.str();
}

Bio MemoryBio(const std::string& pem) {
  return Bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
}

// Every certificate in a PEM file; at least one.
absl::StatusOr<std::vector<Cert>> ParseCertificates(const std::string& name,
                                                    const std::string& pem) {
  ERR_clear_error();
  Bio bio = MemoryBio(pem);
  std::vector<Cert> certs;
  for (;;) {
    Cert cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
    if (!cert) break;
    certs.push_back(std::move(cert));
  }
  // The loop ends at the end of the file ("no start line") or at a block that does not parse.
  const unsigned long e = ERR_peek_last_error();
  const bool clean_end = ERR_GET_LIB(e) == ERR_LIB_PEM && ERR_GET_REASON(e) == PEM_R_NO_START_LINE;
  if (certs.empty()) {
    const std::string reason = OpenSslReason();
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": holds no PEM certificate (", reason, ")"));
  }
  if (e != 0 && !clean_end) {
    const std::string reason = OpenSslReason();
    return absl::InvalidArgumentError(absl::StrCat(name, ": certificate ", certs.size() + 1,
                                                   " in the file does not parse (", reason, ")"));
  }
  ERR_clear_error();
  return certs;
}

// No passphrase prompt (OpenSSL's default asks on the terminal): an encrypted key fails.
int NoPassphrase(char*, int, int, void*) { return -1; }

absl::StatusOr<Key> ParsePrivateKey(const std::string& name, const std::string& pem) {
  ERR_clear_error();
  Bio bio = MemoryBio(pem);
  Key key(PEM_read_bio_PrivateKey(bio.get(), nullptr, NoPassphrase, nullptr));
  if (!key) {
    const std::string reason = OpenSslReason();
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": is not an unencrypted PEM private key (", reason, ")"));
  }
  return key;
}

std::string TimeText(const ASN1_TIME* t) {
  Bio bio(BIO_new(BIO_s_mem()));
  ASN1_TIME_print(bio.get(), t);
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

// Every handshake fails with a server certificate outside its validity: refuse to start.
absl::Status CheckCurrent(const std::string& name, const X509* cert) {
  const ASN1_TIME* before = X509_get0_notBefore(cert);
  const ASN1_TIME* after = X509_get0_notAfter(cert);
  if (X509_cmp_current_time(after) < 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": the certificate expired on ",
                                                   TimeText(after), " (valid from ",
                                                   TimeText(before), ")"));
  }
  if (X509_cmp_current_time(before) > 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": the certificate is not valid before ",
                                                   TimeText(before), " (until ", TimeText(after),
                                                   ")"));
  }
  return absl::OkStatus();
}

// A client CA outside its validity only fails the clients it signed (others may be fine).
void WarnIfNotCurrent(const std::string& name, const X509* cert) {
  if (X509_cmp_current_time(X509_get0_notAfter(cert)) < 0) {
    LOG(WARNING) << name << ": the certificate has expired";
  } else if (X509_cmp_current_time(X509_get0_notBefore(cert)) > 0) {
    LOG(WARNING) << name << ": the certificate is not valid yet";
  }
}

}  // namespace

absl::StatusOr<std::optional<TlsConfig>> LoadTlsConfig(const TlsPaths& paths) {
  if (paths.cert_path.empty() && paths.key_path.empty()) {
    if (!paths.client_ca_path.empty()) {
      return absl::InvalidArgumentError(
          "TLS_CLIENT_CA_CERT_PATH (--tls-client-ca-cert-path) needs TLS_CERT_PATH and "
          "TLS_KEY_PATH: client certificates are only asked for over TLS");
    }
    return std::nullopt;
  }
  if (paths.cert_path.empty()) {
    return absl::InvalidArgumentError(
        "TLS_KEY_PATH is set but TLS_CERT_PATH (--tls-cert-path) is not: TLS needs both");
  }
  if (paths.key_path.empty()) {
    return absl::InvalidArgumentError(
        "TLS_CERT_PATH is set but TLS_KEY_PATH (--tls-key-path) is not: TLS needs both");
  }
  const std::string cert_name = Name("TLS certificate", paths.cert_path, "TLS_CERT_PATH");
  const std::string key_name = Name("TLS key", paths.key_path, "TLS_KEY_PATH");

  TlsConfig config;
  absl::StatusOr<std::string> cert_pem = ReadFile(cert_name, paths.cert_path);
  if (!cert_pem.ok()) return cert_pem.status();
  absl::StatusOr<std::vector<Cert>> certs = ParseCertificates(cert_name, *cert_pem);
  if (!certs.ok()) return certs.status();
  absl::StatusOr<std::string> key_pem = ReadFile(key_name, paths.key_path);
  if (!key_pem.ok()) return key_pem.status();
  absl::StatusOr<Key> key = ParsePrivateKey(key_name, *key_pem);
  if (!key.ok()) return key.status();
  // The first certificate of the file is the server's own; the key must be its key.
  if (X509_check_private_key(certs->front().get(), key->get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat(key_name, ": does not match the certificate ", paths.cert_path));
  }
  if (absl::Status st = CheckCurrent(cert_name, certs->front().get()); !st.ok()) return st;
  config.cert_chain_pem = std::move(*cert_pem);
  config.private_key_pem = std::move(*key_pem);

  if (!paths.client_ca_path.empty()) {
    const std::string ca_name =
        Name("TLS client CA certificate", paths.client_ca_path, "TLS_CLIENT_CA_CERT_PATH");
    absl::StatusOr<std::string> ca_pem = ReadFile(ca_name, paths.client_ca_path);
    if (!ca_pem.ok()) return ca_pem.status();
    absl::StatusOr<std::vector<Cert>> cas = ParseCertificates(ca_name, *ca_pem);
    if (!cas.ok()) return cas.status();
    for (const Cert& ca : *cas) WarnIfNotCurrent(ca_name, ca.get());
    config.client_ca_pem = std::move(*ca_pem);
  }
  return config;
}

}  // namespace tgis::router
