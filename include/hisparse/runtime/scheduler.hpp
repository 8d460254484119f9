#pragma once
// Admission by forecast KV growth (DESIGN.md section 4). A request declares
// its prompt and the most tokens it may generate; once admitted it holds its
// prompt's pages at once (prefill), one more token a step (decode), and frees
// everything when it reaches prompt + max_new tokens. The scheduler admits
// the oldest waiting request only when the forecast of every admitted
// request's memory, step by step until the last one ends, stays within the
// budget with it included: so nothing admitted can run out of memory (never
// start what cannot finish), and no reservation is held for tokens a
// request that ends earlier will not reach.
//
// The forecast's peak: each request's bytes grow until it ends and then
// drop to zero, so the total is largest just before some request ends;
// checking those instants (and now) is exact. O(n^2) in the running
// requests, host only. Admission computes the running requests' totals at
// their instants once (running_profile) and tries each waiting request
// against them in O(n) (peak_with); forecast_peak is the same two steps.
//
// Requests larger than the whole budget are rejected at submit, with the
// reason (and withdrawn by a later, lower budget: set_budget hands them
// back); every other request is eventually admitted (first come, first
// served; a later, smaller request may go first only while the oldest has
// waited fewer than `max_bypass` admissions), so none is lost.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "hisparse/core/status.hpp"

namespace hisparse {

struct serving_request {
  std::int64_t id = 0;
  std::int64_t prompt_tokens = 0;
  std::int64_t max_new_tokens = 0;
  [[nodiscard]] std::int64_t final_tokens() const { return prompt_tokens + max_new_tokens; }
};

class admission_scheduler {
 public:
  /// Device bytes one request holds at `tokens` tokens (nondecreasing), e.g.
  /// its pages over every layer (kv::cache_footprint::sequence_pages times
  /// page_bytes).
  using bytes_function = std::function<std::size_t(std::int64_t tokens)>;

  struct options {
    std::size_t budget_bytes = 0;  ///< what the running requests' pages may hold
    int max_running = 0;           ///< cache slots (0: no limit)
    int max_bypass = 8;            ///< admissions that may pass the oldest waiting request
  };

  admission_scheduler(const options& o, bytes_function bytes_of) : opt_(o), bytes_of_(std::move(bytes_of)) {}

  /// Queues a request; rejects (invalid_argument, with the reason) one
  /// whose final size alone exceeds the budget, or one with no tokens.
  [[nodiscard]] status submit(const serving_request& r) {
    if (r.prompt_tokens < 1 || r.max_new_tokens < 0)
      return fail(status::invalid_argument, "scheduler: request " + std::to_string(r.id) +
                                                " needs a prompt and max_new_tokens >= 0");
    if (bytes_of_(r.final_tokens()) > opt_.budget_bytes)
      return fail(status::invalid_argument, "scheduler: request " + std::to_string(r.id) + " needs " +
                                                std::to_string(bytes_of_(r.final_tokens())) +
                                                " bytes at its last token, more than the budget of " +
                                                std::to_string(opt_.budget_bytes));
    waiting_.push_back({r, 0});
    return status::success;
  }

  /// Admits what fits now, oldest first (see the top of the file); the
  /// admitted requests start holding their prompt. Returns them.
  std::vector<serving_request> admit() {
    std::vector<serving_request> admitted;
    std::vector<instant> profile = running_profile();
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if (opt_.max_running > 0 && static_cast<int>(running_.size()) >= opt_.max_running) break;
      const bool oldest = it == waiting_.begin();
      if (!oldest && waiting_.front().passed >= opt_.max_bypass) break;  // the oldest goes next
      if (peak_with(profile, it->request) <= opt_.budget_bytes) {
        running_.push_back({it->request, it->request.prompt_tokens});
        admitted.push_back(it->request);
        if (!oldest) ++waiting_.front().passed;
        it = waiting_.erase(it);
        profile = running_profile();
      } else {
        ++it;
      }
    }
    return admitted;
  }

  /// One decode step: every running request gains a token; those that
  /// reach their final size end (their pages are freed). Returns them.
  std::vector<serving_request> step() {
    std::vector<serving_request> done;
    for (auto it = running_.begin(); it != running_.end();) {
      if (it->tokens >= it->request.final_tokens()) {
        done.push_back(it->request);
        it = running_.erase(it);
      } else {
        ++it->tokens;
        ++it;
      }
    }
    return done;
  }

  /// A running request that stops early (end of sequence): freed now.
  [[nodiscard]] status finish(std::int64_t id) {
    for (auto it = running_.begin(); it != running_.end(); ++it)
      if (it->request.id == id) {
        running_.erase(it);
        return status::success;
      }
    return fail(status::invalid_argument, "scheduler: request " + std::to_string(id) + " is not running");
  }

  /// Bytes the running requests hold now.
  [[nodiscard]] std::size_t used_bytes() const {
    std::size_t b = 0;
    for (const auto& r : running_) b += bytes_of_(r.tokens);
    return b;
  }
  /// The largest total the running requests (and `candidate`, starting
  /// now with its prompt) will hold before they all end.
  [[nodiscard]] std::size_t forecast_peak(const serving_request* candidate = nullptr) const {
    const std::vector<instant> profile = running_profile();
    if (candidate != nullptr) return peak_with(profile, *candidate);
    std::size_t peak = 0;
    for (const instant& i : profile) peak = std::max(peak, i.total);
    return peak;
  }

  /// Changes the budget later admissions are judged against (running
  /// requests keep going; lowered below forecast_peak(), the running ones
  /// may exceed it until they end, and nothing is admitted until then).
  /// A waiting request whose final size alone exceeds the new budget could
  /// never be admitted (and, once the oldest, would stop every admission):
  /// it leaves the queue into `*withdrawn`, in queue order; without
  /// `withdrawn`, such a budget is refused (invalid_argument, nothing
  /// changed), so no request is dropped unseen.
  [[nodiscard]] status set_budget(std::size_t bytes, std::vector<serving_request>* withdrawn = nullptr) {
    for (const queued& q : waiting_)
      if (withdrawn == nullptr && bytes_of_(q.request.final_tokens()) > bytes)
        return fail(status::invalid_argument,
                    "scheduler: a budget of " + std::to_string(bytes) + " bytes cannot hold waiting request " +
                        std::to_string(q.request.id) + " (" + std::to_string(bytes_of_(q.request.final_tokens())) +
                        " bytes at its last token); pass a list to withdraw such requests into");
    opt_.budget_bytes = bytes;
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if (bytes_of_(it->request.final_tokens()) > bytes) {
        withdrawn->push_back(it->request);
        it = waiting_.erase(it);
      } else {
        ++it;
      }
    }
    return status::success;
  }

  [[nodiscard]] std::size_t waiting() const { return waiting_.size(); }
  [[nodiscard]] std::size_t running_count() const { return running_.size(); }
  [[nodiscard]] const options& settings() const { return opt_; }

 private:
  struct queued {
    serving_request request;
    int passed = 0;  ///< admissions that went before it while it was the oldest
  };
  struct running {
    serving_request request;
    std::int64_t tokens = 0;
  };

  struct instant {
    std::int64_t t = 0;      ///< steps from now
    std::size_t total = 0;   ///< what the running requests hold then
  };

  /// The running requests' totals now and at each one's last step.
  [[nodiscard]] std::vector<instant> running_profile() const {
    std::vector<instant> p;
    p.reserve(running_.size() + 1);
    for (std::size_t k = 0; k <= running_.size(); ++k) {
      const std::int64_t t = k == running_.size() ? 0 : running_[k].request.final_tokens() - running_[k].tokens;
      std::size_t total = 0;
      for (const auto& r : running_)
        if (r.request.final_tokens() - r.tokens >= t) total += bytes_of_(r.tokens + t);
      p.push_back({t, total});
    }
    return p;
  }

  /// forecast_peak(&c) from the running profile: c adds its bytes at the
  /// instants it lives to, and its own last step is one more instant.
  [[nodiscard]] std::size_t peak_with(const std::vector<instant>& profile, const serving_request& c) const {
    const std::int64_t life = c.final_tokens() - c.prompt_tokens;
    std::size_t peak = 0;
    for (const instant& i : profile)
      peak = std::max(peak, i.total + (life >= i.t ? bytes_of_(c.prompt_tokens + i.t) : 0));
    std::size_t last = bytes_of_(c.final_tokens());
    for (const auto& r : running_)
      if (r.request.final_tokens() - r.tokens >= life) last += bytes_of_(r.tokens + life);
    return std::max(peak, last);
  }

  options opt_;
  bytes_function bytes_of_;
  std::deque<queued> waiting_;
  std::vector<running> running_;
};

}  // namespace hisparse
