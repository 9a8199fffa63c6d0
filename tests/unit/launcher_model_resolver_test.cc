// MODEL_NAME resolution: directories as given, hub ids through the local HF cache layout.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "launcher/model_resolver.h"

namespace {

namespace fs = std::filesystem;
using tgis::launcher::CacheDirs;
using tgis::launcher::ResolveModel;

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
  auto r = ResolveModel(model.string(), "", CacheDirs{});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, model.string());
}

TEST_F(ResolverTest, DirectoryWithoutConfigIsAnError) {
  auto r = ResolveModel(root_.string(), "", CacheDirs{});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("config.json"), std::string::npos);
}

TEST_F(ResolverTest, HubIdFollowsRefsMainInHfHubCache) {
  fs::path cache = root_ / "hub";
  fs::path snap = Snapshot(cache, "models--bigscience--bloom-560m", "abc123");
  Ref(cache, "models--bigscience--bloom-560m", "main", "abc123");
  CacheDirs dirs;
  dirs.hf_hub_cache = cache.string();
  auto r = ResolveModel("bigscience/bloom-560m", "", dirs);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, snap.string());
}

TEST_F(ResolverTest, RevisionMayBeACommitOrABranch) {
  fs::path cache = root_ / "home" / "hub";
  Snapshot(cache, "models--org--m", "c1");
  fs::path snap2 = Snapshot(cache, "models--org--m", "c2");
  Ref(cache, "models--org--m", "dev", "c2");
  CacheDirs dirs;
  dirs.hf_home = (root_ / "home").string();
  auto by_commit = ResolveModel("org/m", "c1", dirs);
  ASSERT_TRUE(by_commit.ok()) << by_commit.status();
  EXPECT_EQ(*by_commit, (cache / "models--org--m" / "snapshots" / "c1").string());
  auto by_branch = ResolveModel("org/m", "dev", dirs);
  ASSERT_TRUE(by_branch.ok()) << by_branch.status();
  EXPECT_EQ(*by_branch, snap2.string());
}

TEST_F(ResolverTest, MissingModelSaysWhereItLooked) {
  CacheDirs dirs;
  dirs.hf_hub_cache = (root_ / "a").string();
  dirs.home = (root_ / "h").string();
  auto r = ResolveModel("org/absent", "", dirs);
  ASSERT_FALSE(r.ok());
  const std::string msg(r.status().message());
  EXPECT_NE(msg.find((root_ / "a" / "models--org--absent").string()), std::string::npos) << msg;
  EXPECT_NE(msg.find((root_ / "h" / ".cache" / "huggingface" / "hub").string()), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("Nothing is downloaded"), std::string::npos);
}

}  // namespace
