// TLS configuration checks at start (router/tls_config.h): certificates and keys are made here
// with OpenSSL, and every bad file fails with a message that names it.
#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "router/tls_config.h"

namespace tgis::router {
namespace {

namespace fs = std::filesystem;

std::string PemOf(EVP_PKEY* key) {
  BIO* bio = BIO_new(BIO_s_mem());
  PEM_write_bio_PrivateKey(bio, key, nullptr, nullptr, 0, nullptr, nullptr);
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  std::string pem(data, static_cast<size_t>(n));
  BIO_free(bio);
  return pem;
}

std::string PemOf(X509* cert) {
  BIO* bio = BIO_new(BIO_s_mem());
  PEM_write_bio_X509(bio, cert);
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  std::string pem(data, static_cast<size_t>(n));
  BIO_free(bio);
  return pem;
}

// A self-signed certificate and its key, as PEM.
struct Identity {
  std::string cert_pem, key_pem;
};

// Valid from now + `from_s` to now + `to_s` seconds.
Identity MakeIdentity(const char* common_name, long from_s = 0, long to_s = 3600) {
  EVP_PKEY* key = EVP_PKEY_Q_keygen(nullptr, nullptr, "EC", "P-256");
  X509* cert = X509_new();
  ASN1_INTEGER_set(X509_get_serialNumber(cert), 1);
  X509_gmtime_adj(X509_getm_notBefore(cert), from_s);
  X509_gmtime_adj(X509_getm_notAfter(cert), to_s);
  X509_set_pubkey(cert, key);
  X509_NAME* name = X509_get_subject_name(cert);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(common_name), -1, -1, 0);
  X509_set_issuer_name(cert, name);
  X509_sign(cert, key, EVP_sha256());
  Identity id{PemOf(cert), PemOf(key)};
  X509_free(cert);
  EVP_PKEY_free(key);
  return id;
}

class TlsConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("tgis-tls-test-" + std::to_string(getpid()));
    fs::create_directories(dir_);
    const Identity server = MakeIdentity("localhost");
    const Identity ca = MakeIdentity("test CA");
    const Identity other = MakeIdentity("other");
    cert_ = Write("server.crt", server.cert_pem);
    key_ = Write("server.key", server.key_pem);
    ca_ = Write("ca.crt", ca.cert_pem);
    other_key_ = Write("other.key", other.key_pem);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string Write(const std::string& name, const std::string& text) {
    const fs::path p = dir_ / name;
    std::ofstream(p) << text;
    return p.string();
  }

  fs::path dir_;
  std::string cert_, key_, ca_, other_key_;
};

TEST_F(TlsConfigTest, ACertificateOutsideItsDatesFailsNamingFileAndDates) {
  const Identity expired = MakeIdentity("localhost", -7200, -3600);
  auto c = LoadTlsConfig(
      {Write("expired.crt", expired.cert_pem), Write("expired.key", expired.key_pem), ""});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("expired.crt"), std::string::npos) << c.status();
  EXPECT_NE(c.status().message().find("the certificate expired on "), std::string::npos)
      << c.status();
  EXPECT_NE(c.status().message().find(" GMT"), std::string::npos) << c.status();
  const Identity future = MakeIdentity("localhost", 3600, 7200);
  c = LoadTlsConfig(
      {Write("future.crt", future.cert_pem), Write("future.key", future.key_pem), ""});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("future.crt"), std::string::npos) << c.status();
  EXPECT_NE(c.status().message().find("is not valid before "), std::string::npos) << c.status();
}

TEST_F(TlsConfigTest, NoPathsIsPlaintext) {
  auto c = LoadTlsConfig({});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE(c->has_value());
}

TEST_F(TlsConfigTest, CertificateAndKeyEnableTls) {
  auto c = LoadTlsConfig({cert_, key_, ""});
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->has_value());
  EXPECT_FALSE((*c)->mutual());
  EXPECT_NE((*c)->cert_chain_pem.find("BEGIN CERTIFICATE"), std::string::npos);
  EXPECT_NE((*c)->private_key_pem.find("PRIVATE KEY"), std::string::npos);
}

TEST_F(TlsConfigTest, ClientCaEnablesMutualTls) {
  auto c = LoadTlsConfig({cert_, key_, ca_});
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->has_value());
  EXPECT_TRUE((*c)->mutual());
}

TEST_F(TlsConfigTest, IncompleteSettings) {
  auto c = LoadTlsConfig({cert_, "", ""});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("TLS_KEY_PATH"), std::string::npos) << c.status();
  c = LoadTlsConfig({"", key_, ""});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("TLS_CERT_PATH"), std::string::npos) << c.status();
  c = LoadTlsConfig({"", "", ca_});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("TLS_CLIENT_CA_CERT_PATH"), std::string::npos) << c.status();
}

TEST_F(TlsConfigTest, MissingFilesAreNamed) {
  const std::string missing = (dir_ / "nowhere.crt").string();
  for (const TlsPaths& paths :
       {TlsPaths{missing, key_, ""}, TlsPaths{cert_, missing, ""}, TlsPaths{cert_, key_, missing},
        TlsPaths{dir_.string(), key_, ""}}) {
    auto c = LoadTlsConfig(paths);
    ASSERT_FALSE(c.ok());
    const std::string bad = paths.cert_path == cert_
                                ? (paths.key_path == key_ ? paths.client_ca_path : paths.key_path)
                                : paths.cert_path;
    EXPECT_NE(c.status().message().find(bad), std::string::npos) << c.status();
  }
}

TEST_F(TlsConfigTest, UnparsablePemIsNamed) {
  const std::string junk = Write("junk.pem", "this is not PEM\n");
  const std::string broken =
      Write("broken.crt", "-----BEGIN CERTIFICATE-----\nAAAA!!!!\n-----END CERTIFICATE-----\n");
  for (const TlsPaths& paths :
       {TlsPaths{junk, key_, ""}, TlsPaths{broken, key_, ""}, TlsPaths{cert_, junk, ""},
        TlsPaths{cert_, cert_, ""}, TlsPaths{cert_, key_, junk}, TlsPaths{cert_, key_, key_}}) {
    auto c = LoadTlsConfig(paths);
    ASSERT_FALSE(c.ok()) << paths.cert_path << " " << paths.key_path << " " << paths.client_ca_path;
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
    const std::string bad = paths.cert_path != cert_ ? paths.cert_path
                            : paths.key_path != key_ ? paths.key_path
                                                     : paths.client_ca_path;
    EXPECT_NE(c.status().message().find(bad), std::string::npos) << c.status();
  }
}

TEST_F(TlsConfigTest, KeyOfAnotherCertificateIsNamed) {
  auto c = LoadTlsConfig({cert_, other_key_, ""});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find(other_key_), std::string::npos) << c.status();
  EXPECT_NE(c.status().message().find("does not match"), std::string::npos) << c.status();
}

TEST_F(TlsConfigTest, ChainAndSeveralCasAreAccepted) {
  const Identity intermediate = MakeIdentity("intermediate");
  std::string chain;
  {
    std::ifstream in(cert_);
    chain.assign(std::istreambuf_iterator<char>(in), {});
  }
  const std::string chain_path = Write("chain.crt", chain + intermediate.cert_pem);
  const std::string cas = Write("cas.crt", intermediate.cert_pem + MakeIdentity("ca2").cert_pem);
  auto c = LoadTlsConfig({chain_path, key_, cas});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE((*c)->mutual());
}

}  // namespace
}  // namespace tgis::router
