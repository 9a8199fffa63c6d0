// MODEL_NAME resolution (directories as given, hub ids through the local HF cache layout) and
// the choice of the cache folder from the environment, as TGIS's launcher makes it.
#include "hub/hub_cache.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

namespace {

namespace fs = std::filesystem;
using tgis::hub::CacheDir;
using tgis::hub::ResolveModel;

class ResolverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("tgis_resolver_" + std::to_string(getpid()));
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  fs::path Snapshot(const fs::path& cache, const std::string& repo, const std::string& commit) {
    fs::path snap = cache / repo / "snapshots" / commit;
    fs::create_directories(snap);
    std::ofstream(snap / "config.json") << "{}";
    return snap;
  }
  void Ref(const fs::path& cache, const std::string& repo, const std::string& name,
           const std::string& commit) {
    fs::create_directories(cache / repo / "refs");
    std::ofstream(cache / repo / "refs" / name) << commit;
  }
  fs::path root_;
};

TEST_F(ResolverTest, DirectoryIsUsedAsIs) {
  fs::path model = root_ / "my-model";
  fs::create_directories(model);
  std::ofstream(model / "config.json") << "{}";
  auto r = ResolveModel(model.string(), "", "");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, model.string());
}

TEST_F(ResolverTest, DirectoryWithoutConfigIsAnError) {
  auto r = ResolveModel(root_.string(), "", "");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("config.json"), std::string::npos);
}

TEST_F(ResolverTest, HubIdFollowsRefsMainInHfHubCache) {
  fs::path cache = root_ / "hub";
  fs::path snap = Snapshot(cache, "models--bigscience--bloom-560m", "abc123");
  Ref(cache, "models--bigscience--bloom-560m", "main", "abc123");
  auto r = ResolveModel("bigscience/bloom-560m", "", cache.string());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, snap.string());
}

TEST_F(ResolverTest, RevisionMayBeACommitOrABranch) {
  fs::path cache = root_ / "home" / "hub";
  Snapshot(cache, "models--org--m", "c1");
  fs::path snap2 = Snapshot(cache, "models--org--m", "c2");
  Ref(cache, "models--org--m", "dev", "c2");
  auto by_commit = ResolveModel("org/m", "c1", cache.string());
  ASSERT_TRUE(by_commit.ok()) << by_commit.status();
  EXPECT_EQ(*by_commit, (cache / "models--org--m" / "snapshots" / "c1").string());
  auto by_branch = ResolveModel("org/m", "dev", cache.string());
  ASSERT_TRUE(by_branch.ok()) << by_branch.status();
  EXPECT_EQ(*by_branch, snap2.string());
}

TEST_F(ResolverTest, MissingModelSaysWhereItLooked) {
  auto r = ResolveModel("org/absent", "", (root_ / "a").string());
  ASSERT_FALSE(r.ok());
  const std::string msg(r.status().message());
  EXPECT_NE(msg.find((root_ / "a" / "models--org--absent").string()), std::string::npos) << msg;
}

TEST(CacheDirTest, PrecedenceIsTgisLaunchers) {
  auto dir = [](std::map<std::string, std::string> env) {
    auto d = CacheDir::FromEnvironment(env);
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? d->path : "";
  };
  EXPECT_EQ(dir({{"HF_HUB_CACHE", "/c"}, {"HF_HOME", "/h"}, {"HOME", "/u"}}), "/c");
  EXPECT_EQ(dir({{"TRANSFORMERS_CACHE", "/t"}, {"HF_HOME", "/h"}}), "/t");
  EXPECT_EQ(dir({{"HUGGINGFACE_HUB_CACHE", "/t"}, {"HF_HOME", "/h"}}), "/t");
  EXPECT_EQ(dir({{"HF_HOME", "/h"}, {"HOME", "/u"}}), "/h/hub");
  EXPECT_EQ(dir({{"HOME", "/u"}}), "/u/.cache/huggingface/hub");
  EXPECT_EQ(dir({{"XDG_CACHE_HOME", "/x"}, {"HOME", "/u"}}), "/x/huggingface/hub");
  EXPECT_EQ(dir({{"HF_HOME", "/h"}, {"XDG_CACHE_HOME", "/x"}}), "/h/hub");
  EXPECT_EQ(dir({}), "");
  auto same = CacheDir::FromEnvironment({{"HF_HUB_CACHE", "/c"}, {"TRANSFORMERS_CACHE", "/c"}});
  ASSERT_TRUE(same.ok());
  EXPECT_NE(same->warning.find("TRANSFORMERS_CACHE is deprecated"), std::string::npos);
}

TEST(CacheDirTest, ConflictingCacheVariablesAreAnError) {
  auto d = CacheDir::FromEnvironment({{"HF_HUB_CACHE", "/c"}, {"TRANSFORMERS_CACHE", "/t"}});
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().message(),
            "TRANSFORMERS_CACHE and HF_HUB_CACHE env vars can't be set to different values");
  EXPECT_FALSE(
      CacheDir::FromEnvironment({{"TRANSFORMERS_CACHE", "/t"}, {"HUGGINGFACE_HUB_CACHE", "/u"}})
          .ok());
}

}  // namespace
