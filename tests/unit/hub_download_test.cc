// download-weights' pure parts: TGIS's file selection, the etag checks (against git and
// sha256sum), URL handling and where the token comes from. The transfers themselves are tested
// against a local Hub in tests/integration/test_download_weights.py.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "common/http_client.h"
#include "hub/download.h"

namespace {

namespace fs = std::filesystem;
using tgis::hub::ContentMatchesEtag;
using tgis::hub::ExpandExtensions;
using tgis::hub::IsWeightHubFile;

TEST(HubDownloadTest, ExtensionsGainTheMetadataFilesAsTgis) {
  EXPECT_EQ(ExpandExtensions(".safetensors"),
            (std::vector<std::string>{".safetensors", ".json", ".py", ".model", ".md"}));
  EXPECT_EQ(ExpandExtensions(".json"), std::vector<std::string>{".json"});
  EXPECT_EQ(ExpandExtensions(".bin,.json"), (std::vector<std::string>{".bin", ".json"}));
}

TEST(HubDownloadTest, OnlyTopLevelNonTrainingFilesAreWeights) {
  const auto exts = ExpandExtensions(".safetensors");
  EXPECT_TRUE(IsWeightHubFile("model-00001-of-00002.safetensors", exts));
  EXPECT_TRUE(IsWeightHubFile("config.json", exts));
  EXPECT_TRUE(IsWeightHubFile("tokenizer.model", exts));
  EXPECT_FALSE(IsWeightHubFile("pytorch_model.bin", exts));
  EXPECT_FALSE(IsWeightHubFile("onnx/model.safetensors", exts));
  EXPECT_FALSE(IsWeightHubFile("training_args.json", exts));
  EXPECT_FALSE(IsWeightHubFile("args.json", exts));
  EXPECT_FALSE(IsWeightHubFile("arguments.json", exts));
}

TEST(HubDownloadTest, EtagsAreCheckedAsGitBlobSha1OrSha256) {
  const fs::path f = fs::temp_directory_path() / ("tgis_etag_" + std::to_string(getpid()));
  std::ofstream(f) << "hello\n";
  // `printf 'hello\n' | git hash-object --stdin` and `| sha256sum`.
  auto git = ContentMatchesEtag(f.string(), "ce013625030ba8dba906f756967f9e9ca394464a");
  ASSERT_TRUE(git.ok()) << git.status();
  EXPECT_TRUE(*git);
  auto lfs = ContentMatchesEtag(f.string(),
                                "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03");
  ASSERT_TRUE(lfs.ok()) << lfs.status();
  EXPECT_TRUE(*lfs);
  auto wrong = ContentMatchesEtag(f.string(), std::string(64, '0'));
  ASSERT_TRUE(wrong.ok());
  EXPECT_FALSE(*wrong);
  EXPECT_FALSE(ContentMatchesEtag(f.string(), "not-a-hash").ok());
  fs::remove(f);
}

TEST(HubDownloadTest, UrlsAreQuotedAndRedirectsResolved) {
  using tgis::ResolveLocation;
  using tgis::UrlQuote;
  EXPECT_EQ(UrlQuote("refs/pr/1", ""), "refs%2Fpr%2F1");
  EXPECT_EQ(UrlQuote("a b/c.json"), "a%20b/c.json");
  EXPECT_EQ(tgis::UrlOrigin("https://hf.co:8443/a/b"), "https://hf.co:8443");
  EXPECT_EQ(ResolveLocation("http://h:1/org/m/resolve/main/x", "/api/x"), "http://h:1/api/x");
  EXPECT_EQ(ResolveLocation("http://h:1/a", "https://cdn/x"), "https://cdn/x");
}

TEST(HubDownloadTest, TokenComesFromHfTokenThenTheTokenFile) {
  const fs::path home = fs::temp_directory_path() / ("tgis_token_" + std::to_string(getpid()));
  fs::create_directories(home);
  std::ofstream(home / "token") << "from-file\n";
  unsetenv("HF_TOKEN_PATH");
  unsetenv("HUGGING_FACE_HUB_TOKEN");
  setenv("HF_HOME", home.c_str(), 1);
  setenv("HF_TOKEN", "from-env", 1);
  EXPECT_EQ(tgis::hub::TokenFromEnvironment(), "from-env");
  unsetenv("HF_TOKEN");
  EXPECT_EQ(tgis::hub::TokenFromEnvironment(), "from-file");
  unsetenv("HF_HOME");
  fs::remove_all(home);
}

}  // namespace
