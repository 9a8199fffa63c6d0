// The tensor-parallel pieces below the model: how a DecoderSpec splits over ranks
// (ShardLayout), and the Gloo communicator (ranks in threads of this process, TCP on loopback)
// with its file rendezvous, stale state from a crashed group included.
#include "server/communicator.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <functional>
#include <thread>

#include "server/decoder_model.h"
#include "server/gloo_communicator.h"
#include "server/nccl_communicator.h"

namespace {

namespace fs = std::filesystem;
using tgis::kernels::DType;
using tgis::kernels::Tensor;
using tgis::server::Communicator;
using tgis::server::ConnectGloo;
using tgis::server::DecoderSpec;
using tgis::server::GlooOptions;
using tgis::server::ShardLayout;

DecoderSpec Spec(int64_t heads, int64_t kv_heads, int64_t inter = 128, int64_t vocab = 1502) {
  DecoderSpec s;
  s.hidden = 64;
  s.num_layers = 2;
  s.num_heads = heads;
  s.num_kv_heads = kv_heads;
  s.head_dim = 16;
  s.intermediate = inter;
  s.vocab = vocab;
  return s;
}

TEST(ShardLayoutTest, WorldSizeOneHoldsEverything) {
  auto l = ShardLayout::Make(Spec(4, 2), 0, 1);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->q_heads.begin, 0);
  EXPECT_EQ(l->q_heads.end, 4);
  EXPECT_EQ(l->kv_heads.end, 2);
  EXPECT_FALSE(l->kv_replicated);
  EXPECT_EQ(l->intermediate.end, 128);
  EXPECT_EQ(l->vocab.end, 1502);
  EXPECT_EQ(l->vocab_chunk, 1502);
}

TEST(ShardLayoutTest, SplitsHeadsMlpAndAnUnevenVocabulary) {
  for (int r = 0; r < 2; ++r) {
    auto l = ShardLayout::Make(Spec(4, 2, 128, 1501), r, 2);
    ASSERT_TRUE(l.ok()) << l.status();
    EXPECT_EQ(l->q_heads.begin, 2 * r);
    EXPECT_EQ(l->q_heads.size(), 2);
    EXPECT_EQ(l->kv_heads.begin, r);
    EXPECT_EQ(l->kv_heads.size(), 1);
    EXPECT_FALSE(l->kv_replicated);
    EXPECT_EQ(l->intermediate.begin, 64 * r);
    EXPECT_EQ(l->intermediate.size(), 64);
    EXPECT_EQ(l->vocab_chunk, 751);
    EXPECT_EQ(l->vocab.begin, 751 * r);
    EXPECT_EQ(l->vocab.end, r == 0 ? 751 : 1501);  // the last rank holds fewer
  }
}

TEST(ShardLayoutTest, FewerKvHeadsThanRanksKeepsTheSharedOne) {
  // GQA 4 q / 2 kv heads on 4 ranks: ranks 0, 1 use KV head 0; ranks 2, 3 KV head 1.
  for (int r = 0; r < 4; ++r) {
    auto l = ShardLayout::Make(Spec(4, 2), r, 4);
    ASSERT_TRUE(l.ok()) << l.status();
    EXPECT_EQ(l->q_heads.begin, r);
    EXPECT_EQ(l->kv_heads.begin, r / 2);
    EXPECT_EQ(l->kv_heads.size(), 1);
    EXPECT_TRUE(l->kv_replicated);
  }
  // MQA: every rank keeps the one KV head.
  for (int r = 0; r < 2; ++r) {
    auto l = ShardLayout::Make(Spec(4, 1), r, 2);
    ASSERT_TRUE(l.ok()) << l.status();
    EXPECT_EQ(l->kv_heads.begin, 0);
    EXPECT_EQ(l->kv_heads.end, 1);
    EXPECT_TRUE(l->kv_replicated);
  }
}

TEST(ShardLayoutTest, IndivisibleSizesAreErrors) {
  EXPECT_FALSE(ShardLayout::Make(Spec(4, 4), 0, 3).ok());       // heads
  EXPECT_FALSE(ShardLayout::Make(Spec(4, 4, 130), 0, 4).ok());  // MLP
  EXPECT_FALSE(ShardLayout::Make(Spec(8, 6), 0, 4).ok());       // KV heads >= ranks, uneven
  EXPECT_FALSE(ShardLayout::Make(Spec(12, 3), 0, 4).ok());      // ranks not a multiple of KV
  EXPECT_FALSE(ShardLayout::Make(Spec(4, 2), 2, 2).ok());       // rank out of range
}

// Granite 4.0-H-style mixers: 8 heads of 16 in `groups` groups, state 16.
DecoderSpec MambaSpec(int64_t groups) {
  DecoderSpec s = Spec(4, 2);
  s.mamba_layers = {true, false};
  s.mamba.ssm = {.heads = 8, .head_dim = 16, .groups = groups, .state_size = 16, .conv_kernel = 4};
  return s;
}

TEST(ShardLayoutTest, MambaHeadsSplitAndTheirGroupsSplitOrAreShared) {
  // 4 groups over 2 ranks: 2 each, beside 4 heads each.
  for (int r = 0; r < 2; ++r) {
    auto l = ShardLayout::Make(MambaSpec(4), r, 2);
    ASSERT_TRUE(l.ok()) << l.status();
    EXPECT_EQ(l->mamba_heads.begin, 4 * r);
    EXPECT_EQ(l->mamba_heads.size(), 4);
    EXPECT_EQ(l->mamba_groups.begin, 2 * r);
    EXPECT_EQ(l->mamba_groups.size(), 2);
    EXPECT_EQ(l->mamba.ssm.heads, 4);
    EXPECT_EQ(l->mamba.ssm.groups, 2);
    EXPECT_EQ(l->mamba.conv_channels(), 4 * 16 + 2 * 2 * 16);
  }
  // 2 groups over 4 ranks: ranks 0, 1 read group 0 (heads 0-3), ranks 2, 3 group 1.
  for (int r = 0; r < 4; ++r) {
    auto l = ShardLayout::Make(MambaSpec(2), r, 4);
    ASSERT_TRUE(l.ok()) << l.status();
    EXPECT_EQ(l->mamba_heads.begin, 2 * r);
    EXPECT_EQ(l->mamba_groups.begin, r / 2);
    EXPECT_EQ(l->mamba.ssm.groups, 1);
  }
  // One group (Granite 4.0-H): every rank keeps it.
  auto l = ShardLayout::Make(MambaSpec(1), 1, 2);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->mamba_groups.begin, 0);
  EXPECT_EQ(l->mamba.ssm.groups, 1);
  EXPECT_EQ(l->mamba.ssm.heads, 4);
}

TEST(ShardLayoutTest, MambaSplitsThatCutAGroupAreErrors) {
  DecoderSpec s = MambaSpec(2);
  s.mamba.ssm.heads = 6;  // 3 heads a group; over 4 ranks heads do not divide
  EXPECT_NE(ShardLayout::Make(s, 0, 4).status().message().find("Mamba-2 heads"), std::string::npos);
  s.mamba.ssm = {.heads = 12, .head_dim = 16, .groups = 3, .state_size = 16, .conv_kernel = 4};
  auto cut = ShardLayout::Make(s, 0, 2);  // rank 0's heads 0-5 would read groups 0 and half of 1
  ASSERT_FALSE(cut.ok());
  EXPECT_NE(cut.status().message().find("Mamba-2 groups (3) and the world size (2)"),
            std::string::npos)
      << cut.status();
}

TEST(SingleProcessCommunicatorTest, CollectivesAreTheIdentity) {
  auto comm = tgis::server::MakeSingleProcessCommunicator();
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->world_size(), 1);
  Tensor x = Tensor::FromVector(std::vector<float>{1, 2, 3}, {3});
  comm->AllReduceSum(&x);
  EXPECT_EQ(x.data<float>()[2], 3);
  Tensor all;
  comm->AllGather(x, &all);
  EXPECT_EQ(all.shape(), (tgis::kernels::Shape{1, 3}));
  EXPECT_EQ(all.data<float>()[1], 2);
}

// NCCL with one rank on the GPU (one GPU is what the project is lent): the real NCCL calls on
// the kernels' stream, whose collectives over one rank give back their input; CPU tensors go
// to the host group. Several ranks over NCCL remain unproven here.
TEST(NcclTest, OneRankCollectivesOnTheGpu) {
  if (!tgis::server::NcclAvailable()) GTEST_SKIP() << "this build has no NCCL";
  if (tgis::kernels::GpuCount() == 0) GTEST_SKIP() << "CUDA not built/available";
  tgis::kernels::SelectGpu(0);
  auto comm = tgis::server::ConnectNccl(tgis::server::MakeSingleProcessCommunicator());
  ASSERT_TRUE(comm.ok()) << comm.status();
  EXPECT_EQ((*comm)->world_size(), 1);
  const std::vector<float> values = {1.0f, -2.5f, 3.0f, 4.5f};
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    Tensor x = Tensor::FromVector(values, {4}).To(dtype).ToDevice(tgis::kernels::Device::kCuda);
    (*comm)->AllReduceSum(&x);
    Tensor all;
    (*comm)->AllGather(x, &all);
    (*comm)->Broadcast(&x, 0);
    const Tensor x_h = x.ToDevice(tgis::kernels::Device::kCpu).To(DType::kF32);
    const Tensor all_h = all.ToDevice(tgis::kernels::Device::kCpu).To(DType::kF32);
    EXPECT_EQ(all.shape(), (tgis::kernels::Shape{1, 4}));
    for (size_t i = 0; i < values.size(); ++i) {
      EXPECT_EQ(x_h.data<float>()[i], values[i]) << tgis::kernels::DTypeName(dtype);
      EXPECT_EQ(all_h.data<float>()[i], values[i]) << tgis::kernels::DTypeName(dtype);
    }
  }
  Tensor host = Tensor::FromVector(values, {4});
  (*comm)->AllReduceSum(&host);
  EXPECT_EQ(host.data<float>()[3], 4.5f);
  (*comm)->Barrier();
}

class GlooTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!tgis::server::GlooAvailable()) GTEST_FAIL() << "this build has no Gloo (libgloo-dev)";
    char tmpl[] = "/tmp/tgis-gloo-test-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  GlooOptions Options(int rank, int world) const {
    GlooOptions o;
    o.rank = rank;
    o.world_size = world;
    o.rendezvous_dir = dir_;
    o.timeout = std::chrono::seconds(30);
    return o;
  }

  // Runs body(comm) on `world` ranks, each in its own thread; rank r starts after delays[r] ms.
  void OnRanks(int world, const std::function<void(Communicator&)>& body,
               std::vector<int> delays_ms = {}) {
    std::vector<std::thread> threads;
    for (int r = 0; r < world; ++r) {
      threads.emplace_back([&, r] {
        if (r < static_cast<int>(delays_ms.size())) {
          std::this_thread::sleep_for(std::chrono::milliseconds(delays_ms[r]));
        }
        auto comm = ConnectGloo(Options(r, world));
        ASSERT_TRUE(comm.ok()) << "rank " << r << ": " << comm.status();
        EXPECT_EQ((*comm)->rank(), r);
        EXPECT_EQ((*comm)->world_size(), world);
        body(**comm);
      });
    }
    for (auto& t : threads) t.join();
  }

  std::string dir_;
};

TEST_F(GlooTest, CollectivesOnTwoAndThreeRanks) {
  for (int world : {2, 3}) {
    OnRanks(world, [world](Communicator& c) {
      const int r = c.rank();
      for (int step = 0; step < 20; ++step) {
        // AllReduceSum: sum over ranks of (r + 1) * (i + step).
        Tensor x = Tensor::Empty({2, 3}, DType::kF32);
        for (int i = 0; i < 6; ++i) x.data<float>()[i] = static_cast<float>((r + 1) * (i + step));
        c.AllReduceSum(&x);
        const int ranks_sum = world * (world + 1) / 2;
        for (int i = 0; i < 6; ++i) {
          ASSERT_EQ(x.data<float>()[i], static_cast<float>(ranks_sum * (i + step)));
        }
        // AllGather: rank k's rows at [k].
        Tensor local =
            Tensor::FromVector(std::vector<float>{float(r), float(10 * r + step)}, {1, 2});
        Tensor all;
        c.AllGather(local, &all);
        ASSERT_EQ(all.shape(), (tgis::kernels::Shape{world, 1, 2}));
        for (int k = 0; k < world; ++k) {
          EXPECT_EQ(all.data<float>()[2 * k], float(k));
          EXPECT_EQ(all.data<float>()[2 * k + 1], float(10 * k + step));
        }
      }
      int64_t v[2] = {100 + r, 5 - r};
      c.AllReduceMin(std::span<int64_t>(v, 2));
      EXPECT_EQ(v[0], 100);
      EXPECT_EQ(v[1], 5 - (world - 1));
      Tensor b = Tensor::FromVector(std::vector<int32_t>{r, r, r}, {3});
      c.Broadcast(&b, world - 1);
      EXPECT_EQ(b.data<int32_t>()[0], world - 1);
      c.Barrier();
    });
  }
}

TEST_F(GlooTest, LateRankZeroAndStaleStateFromACrashedGroup) {
  // A group that "crashed": keep a copy of its live rendezvous state and put it back after the
  // group is gone, with real (now closed) addresses in it.
  const fs::path backup = fs::path(dir_ + "-backup");
  OnRanks(2, [&](Communicator& c) {
    c.Barrier();
    if (c.rank() == 0) fs::copy(dir_, backup, fs::copy_options::recursive);
    c.Barrier();
  });
  fs::remove_all(dir_);
  fs::rename(backup, dir_);
  ASSERT_TRUE(fs::exists(fs::path(dir_) / "session"));
  // Rank 1 starts first and reads the stale session; rank 0 comes 500 ms later.
  OnRanks(2,
          [](Communicator& c) {
            Tensor x = Tensor::FromVector(std::vector<float>{1.0f + c.rank()}, {1});
            c.AllReduceSum(&x);
            EXPECT_EQ(x.data<float>()[0], 3.0f);
          },
          {500, 0});
  // Rank 0 leaves only its lock file behind.
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir_)) left.push_back(e.path().filename());
  EXPECT_EQ(left, std::vector<std::string>{"lock"});
}

TEST_F(GlooTest, ASecondGroupOnTheSameDirectoryIsRefused) {
  OnRanks(2, [&](Communicator& c) {
    c.Barrier();
    if (c.rank() == 0) {
      auto other = ConnectGloo(Options(0, 2));
      ASSERT_FALSE(other.ok());
      EXPECT_EQ(other.status().code(), absl::StatusCode::kAlreadyExists);
      EXPECT_NE(other.status().message().find("MASTER_PORT"), std::string::npos);
    }
    c.Barrier();
  });
}

TEST(GlooRendezvousDirTest, NamedAfterMasterAddressAndPort) {
  const std::string d = tgis::server::DefaultRendezvousDir("localhost", 29500);
  EXPECT_NE(d.find("tgis-rendezvous-localhost-29500"), std::string::npos) << d;
  EXPECT_EQ(tgis::server::DefaultRendezvousDir("a/b", 1).find("a/b"), std::string::npos);
}

}  // namespace
