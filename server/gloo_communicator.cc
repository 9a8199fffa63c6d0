#include "server/gloo_communicator.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "absl/strings/str_cat.h"

#ifdef TGIS_WITH_GLOO
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#endif

namespace tgis::server {

namespace fs = std::filesystem;

std::string DefaultRendezvousDir(const std::string& master_addr, int master_port) {
  std::string addr;
  for (char c : master_addr) {
    addr.push_back(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' ? c : '_');
  }
  std::error_code ec;
  fs::path tmp = fs::temp_directory_path(ec);
  if (ec) tmp = "/tmp";
  return (tmp / absl::StrCat("tgis-rendezvous-", addr, "-", master_port)).string();
}

#ifndef TGIS_WITH_GLOO

bool GlooAvailable() { return false; }

absl::StatusOr<std::shared_ptr<Communicator>> ConnectGloo(const GlooOptions&) {
  return absl::UnimplementedError(
      "tensor parallelism on the CPU needs Gloo: this build has none (install libgloo-dev and "
      "reconfigure)");
}

#else  // TGIS_WITH_GLOO

bool GlooAvailable() { return true; }

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void Fatal(const std::string& what) {
  std::fprintf(stderr, "FATAL gloo communicator: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

// Thrown by the store of a rank that sees rank 0 publish another session than the one it joined.
struct SessionChanged : std::runtime_error {
  SessionChanged() : std::runtime_error("the rendezvous session changed") {}
};

std::string ReadFile(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) return "";
  std::stringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

// Writes through a temporary file and a rename, so readers see all of it or nothing.
void WriteFileAtomically(const fs::path& p, const std::string& data) {
  static std::atomic<uint64_t> counter{0};
  const fs::path tmp = p.parent_path() / absl::StrCat(".", p.filename().string(), ".", getpid(),
                                                      ".", counter.fetch_add(1), ".tmp");
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw std::runtime_error(absl::StrCat("cannot write ", tmp.string()));
    out.write(data.data(), static_cast<std::streamsize>(data.size()));
    if (!out) throw std::runtime_error(absl::StrCat("cannot write ", tmp.string()));
  }
  std::error_code ec;
  fs::rename(tmp, p, ec);
  if (ec) {
    fs::remove(tmp, ec);
    throw std::runtime_error(absl::StrCat("cannot rename to ", p.string()));
  }
}

// A key-value store of files in one session directory. Keys are hex-encoded into file names.
class SessionStore final : public gloo::rendezvous::Store {
 public:
  // `session_file` and `session`: when set, waits fail with SessionChanged once the session
  // file names another session (rank 0 restarted the rendezvous).
  SessionStore(fs::path dir, fs::path session_file, std::string session,
               std::chrono::milliseconds timeout)
      : dir_(std::move(dir)),
        session_file_(std::move(session_file)),
        session_(std::move(session)),
        timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    WriteFileAtomically(Path(key), std::string(data.begin(), data.end()));
  }

  std::vector<char> get(const std::string& key) override {
    wait({key});
    const std::string s = ReadFile(Path(key));
    return std::vector<char>(s.begin(), s.end());
  }

  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }

  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    const auto deadline = Clock::now() + std::min(timeout, timeout_);
    for (;;) {
      bool all = true;
      for (const std::string& k : keys) {
        std::error_code ec;
        all = all && fs::exists(Path(k), ec);
      }
      if (all) return;
      if (!session_file_.empty() && ReadFile(session_file_) != session_) throw SessionChanged();
      if (Clock::now() > deadline) {
        throw std::runtime_error(
            absl::StrCat("timed out waiting for the other ranks in ", dir_.string()));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }

 private:
  fs::path Path(const std::string& key) const {
    std::string name = "k";
    for (unsigned char c : key) absl::StrAppend(&name, absl::Hex(c, absl::kZeroPad2));
    return dir_ / name;
  }

  fs::path dir_;
  fs::path session_file_;
  std::string session_;
  std::chrono::milliseconds timeout_;
};

class GlooCommunicator final : public Communicator {
 public:
  // Rank 0 passes its lock file descriptors and its session directory, which it removes at the end.
  GlooCommunicator(std::shared_ptr<gloo::Context> context, std::vector<int> fds,
                   fs::path session_dir)
      : context_(std::move(context)), fds_(std::move(fds)), session_dir_(std::move(session_dir)) {}

  ~GlooCommunicator() override {
    context_.reset();
    if (!session_dir_.empty()) {
      // Rank 0: the session is over; leave only the lock file.
      std::error_code ec;
      fs::remove_all(session_dir_, ec);
      fs::remove(session_dir_.parent_path() / "session", ec);
    }
    for (int fd : fds_) ::close(fd);
  }

  int rank() const override { return context_->rank; }
  int world_size() const override { return context_->size; }

  void AllReduceSum(kernels::Tensor* x) override {
    Check(*x, "AllReduceSum");
    Run("AllReduceSum", [&] {
      gloo::AllreduceOptions opts(context_);
      opts.setOutput(x->data<float>(), static_cast<size_t>(x->numel()));
      opts.setReduceFunction(
          static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
      opts.setTag(NextTag());
      gloo::allreduce(opts);
    });
  }

  void AllReduceMin(std::span<int64_t> values) override {
    Run("AllReduceMin", [&] {
      gloo::AllreduceOptions opts(context_);
      opts.setOutput(values.data(), values.size());
      opts.setReduceFunction(
          static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::min<int64_t>));
      opts.setTag(NextTag());
      gloo::allreduce(opts);
    });
  }

  void AllGather(const kernels::Tensor& local, kernels::Tensor* out) override {
    Check(local, "AllGather");
    kernels::Shape shape = {world_size()};
    shape.insert(shape.end(), local.shape().begin(), local.shape().end());
    if (!out->defined()) *out = kernels::Tensor::Empty(shape, kernels::DType::kF32);
    if (out->shape() != shape || out->dtype() != kernels::DType::kF32) {
      Fatal("AllGather: the output must be [world_size, local shape...] f32");
    }
    Run("AllGather", [&] {
      gloo::AllgatherOptions opts(context_);
      opts.setInput(local.data<float>(), static_cast<size_t>(local.numel()));
      opts.setOutput(out->data<float>(), static_cast<size_t>(out->numel()));
      opts.setTag(NextTag());
      gloo::allgather(opts);
    });
  }

  void Broadcast(kernels::Tensor* x, int root) override {
    if (x->device() != kernels::Device::kCpu) Fatal("Broadcast: CPU tensors only");
    Run("Broadcast", [&] {
      gloo::BroadcastOptions opts(context_);
      opts.setOutput(static_cast<uint8_t*>(x->raw()), x->nbytes());
      opts.setRoot(root);
      opts.setTag(NextTag());
      gloo::broadcast(opts);
    });
  }

  void Barrier() override {
    Run("Barrier", [&] {
      gloo::BarrierOptions opts(context_);
      opts.setTag(NextTag());
      gloo::barrier(opts);
    });
  }

 private:
  static void Check(const kernels::Tensor& t, const char* op) {
    if (t.device() != kernels::Device::kCpu || t.dtype() != kernels::DType::kF32) {
      Fatal(absl::StrCat(op, ": CPU f32 tensors only, got ", t.DebugString()));
    }
  }

  template <typename F>
  void Run(const char* op, F&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      Fatal(absl::StrCat(op, " failed on rank ", rank(), " of ", world_size(), ": ", e.what()));
    }
  }

  // Every rank issues the same collectives in the same order, so the counters agree.
  uint32_t NextTag() { return tag_++; }

  std::shared_ptr<gloo::Context> context_;
  std::vector<int> fds_;
  fs::path session_dir_;
  uint32_t tag_ = 0;
};

// connectFullMesh returns when this rank's links are up, which may be before its peers have
// finished theirs; a barrier makes the rendezvous complete for everyone before it returns.
void ConfirmConnected(const std::shared_ptr<gloo::Context>& context) {
  gloo::BarrierOptions opts(context);
  opts.setTag(0xffffffffu);
  gloo::barrier(opts);
}

std::string NewSessionId() {
  std::random_device rd;
  std::mt19937_64 gen((static_cast<uint64_t>(rd()) << 32) ^ rd() ^
                      static_cast<uint64_t>(Clock::now().time_since_epoch().count()));
  return absl::StrCat(absl::Hex(gen(), absl::kZeroPad16), "-", getpid());
}

}  // namespace

absl::StatusOr<std::shared_ptr<Communicator>> ConnectGloo(const GlooOptions& o) {
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", o.rank, " is not in [0, world size ", o.world_size, ")"));
  }
  if (o.rendezvous_dir.empty()) return absl::InvalidArgumentError("no rendezvous directory");
  const fs::path base(o.rendezvous_dir);
  const fs::path session_file = base / "session";
  std::error_code ec;
  fs::create_directories(base, ec);
  if (ec) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create the rendezvous directory ", base.string(), ": ", ec.message()));
  }
  gloo::transport::tcp::attr attr;
  if (!o.iface.empty()) {
    attr.iface = o.iface;
  } else {
    attr.hostname = o.hostname;
  }
  std::shared_ptr<gloo::transport::Device> device;
  try {
    device = gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(
        "Gloo TCP device on ", o.iface.empty() ? o.hostname : o.iface, ": ", e.what()));
  }
  const auto deadline = Clock::now() + o.timeout;

  if (o.rank == 0) {
    const fs::path lock = base / "lock";
    const int lock_fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (lock_fd < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot open ", lock.string(), ": ", std::strerror(errno)));
    }
    if (::flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
      ::close(lock_fd);
      return absl::AlreadyExistsError(absl::StrCat(
          "another shard group is using the rendezvous directory ", base.string(),
          " (its rank 0 holds ", lock.string(), "); give this group another MASTER_PORT"));
    }
    // Whatever is here besides the lock was left by a group whose rank 0 has exited.
    for (const auto& e : fs::directory_iterator(base, ec)) {
      if (e.path().filename() != "lock") fs::remove_all(e.path(), ec);
    }
    const std::string session = NewSessionId();
    const fs::path dir = base / session;
    fs::create_directories(dir, ec);
    // The session file is locked (exclusively) for as long as this rank 0 lives: another rank
    // that finds it unlocked knows it is stale. The lock is taken before the file is renamed
    // into place, so no rank ever sees the new session unlocked.
    const fs::path tmp = base / absl::StrCat(".session.", session);
    const int session_fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (session_fd < 0 || ::flock(session_fd, LOCK_EX | LOCK_NB) != 0 ||
        ::write(session_fd, session.data(), session.size()) !=
            static_cast<ssize_t>(session.size()) ||
        ::rename(tmp.c_str(), session_file.c_str()) != 0) {
      const std::string err = std::strerror(errno);
      if (session_fd >= 0) ::close(session_fd);
      ::close(lock_fd);
      return absl::FailedPreconditionError(
          absl::StrCat("cannot publish the rendezvous session in ", base.string(), ": ", err));
    }
    try {
      SessionStore store(dir, "", "", o.timeout);
      auto context = std::make_shared<gloo::rendezvous::Context>(0, o.world_size);
      context->setTimeout(o.timeout);
      context->connectFullMesh(store, device);
      ConfirmConnected(context);
      return std::shared_ptr<Communicator>(std::make_shared<GlooCommunicator>(
          std::move(context), std::vector<int>{session_fd, lock_fd}, dir));
    } catch (const std::exception& e) {
      fs::remove_all(dir, ec);
      fs::remove(session_file, ec);
      ::close(session_fd);
      ::close(lock_fd);
      return absl::DeadlineExceededError(
          absl::StrCat("rank 0: rendezvous in ", dir.string(), " failed: ", e.what()));
    }
  }

  // Other ranks: join the session of a live rank 0 (one that holds the lock on the session file
  // it published); start over when it publishes another.
  std::string last_error = "no session published by rank 0 yet";
  while (Clock::now() < deadline) {
    std::string session;
    {
      const int fd = ::open(session_file.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd >= 0) {
        char buf[128];
        const ssize_t n = ::read(fd, buf, sizeof(buf));
        if (n > 0 && ::flock(fd, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK) {
          session.assign(buf, static_cast<size_t>(n));
        } else if (n > 0) {
          last_error = "the published session is stale (its rank 0 has exited)";
        }
        ::close(fd);
      }
    }
    if (session.empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    try {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      SessionStore store(base / session, session_file, session, left);
      auto context = std::make_shared<gloo::rendezvous::Context>(o.rank, o.world_size);
      context->setTimeout(left);
      context->connectFullMesh(store, device);
      ConfirmConnected(context);
      context->setTimeout(o.timeout);
      return std::shared_ptr<Communicator>(
          std::make_shared<GlooCommunicator>(std::move(context), std::vector<int>{}, fs::path()));
    } catch (const SessionChanged&) {
      last_error = "rank 0 restarted the rendezvous";
    } catch (const std::exception& e) {
      last_error = e.what();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  return absl::DeadlineExceededError(
      absl::StrCat("rank ", o.rank, ": rendezvous in ", base.string(), " timed out: ", last_error));
}

#endif  // TGIS_WITH_GLOO

}  // namespace tgis::server
