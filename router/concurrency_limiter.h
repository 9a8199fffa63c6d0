// MAX_CONCURRENT_REQUESTS: requests (each input of a batched Generate counts) beyond the limit
// are refused at once rather than queued.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>

namespace tgis::router {

class ConcurrencyLimiter {
 public:
  explicit ConcurrencyLimiter(uint32_t limit) : available_(limit) {}

  // Holds n slots until destroyed.
  class Permit {
   public:
    Permit(Permit&& other) noexcept : limiter_(other.limiter_), n_(other.n_) {
      other.limiter_ = nullptr;
    }
    Permit& operator=(Permit&&) = delete;
    ~Permit() {
      if (limiter_ != nullptr) limiter_->Release(n_);
    }

   private:
    friend class ConcurrencyLimiter;
    Permit(ConcurrencyLimiter* limiter, uint32_t n) : limiter_(limiter), n_(n) {}
    ConcurrencyLimiter* limiter_;
    uint32_t n_;
  };

  std::optional<Permit> TryAcquire(uint32_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    if (n > available_) return std::nullopt;
    available_ -= n;
    return Permit(this, n);
  }

 private:
  void Release(uint32_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    available_ += n;
  }

  std::mutex mu_;
  uint32_t available_;
};

}  // namespace tgis::router
