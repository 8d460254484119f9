#pragma once
// The KV page pool (DESIGN.md section 3): fixed-size pages carved from large
// chunks taken from a memory resource.
//
// Why fixed pages: a sequence's KV cache grows one page at a time and is
// addressed through a page table, so it never needs contiguous memory. Any
// free page serves any request, which means fragmentation can never make a
// request fail while enough pages are free; the fragmentation statistic only
// says how scattered the free pages are (for compaction or chunk release
// decisions), never whether growth will succeed.
//
// Why chunks: one resource call per page would put a (possibly synchronizing)
// allocation on the decode path for every 16 tokens; a chunk amortizes it over
// many pages, and the pool hands pages out from a free list in O(1).
//
// Not thread-safe: a pool has one owner at a time (like a CUDA stream);
// callers on several threads must serialize their calls themselves.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <limits>
#include <new>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "hisparse/core/status.hpp"
#include "hisparse/mr/resource.hpp"

namespace hisparse::kv {

/// Index of a page in its pool. int32 because page tables are int32 on the
/// device (half the bytes of int64 per table entry read by every kernel).
using page_id = std::int32_t;
inline constexpr page_id kInvalidPage = -1;

/// The most pages a pool may hold: every id must fit in page_id.
inline constexpr std::int64_t kMaxPages = std::numeric_limits<page_id>::max();

struct page_pool_options {
  std::size_t page_bytes = 0;                      ///< required; a multiple of mr::kAlignment
  std::size_t chunk_bytes = std::size_t{1} << 20;  ///< chunks hold floor(chunk/page) pages, at least 1
  std::size_t max_bytes = SIZE_MAX;                ///< cap on bytes taken from the resource
  std::int64_t reserve_pages = 0;                  ///< grow to at least this many pages up front
  cudaStream_t stream = nullptr;                   ///< stream for chunk allocate/deallocate
};

struct page_pool_stats {
  std::int64_t pages_total = 0;
  std::int64_t pages_used = 0;
  std::int64_t pages_free = 0;
  std::int64_t peak_pages_used = 0;
  std::int64_t chunks = 0;
  std::int64_t largest_free_run = 0;  ///< most consecutive free page ids inside one chunk
  double fragmentation = 0;           ///< 1 - largest_free_run / pages_free; 0 when nothing is free
  std::size_t bytes_reserved = 0;     ///< bytes taken from the resource
};

template <mr::resource Resource>
class page_pool {
 public:
  /// Validates `options` (throws hisparse::error(invalid_argument) naming the
  /// field) and grows to `options.reserve_pages` (throws the failure's status
  /// with its reason, having returned what it took).
  page_pool(Resource& resource, const page_pool_options& options)
      : resource_(&resource), options_(options) {
    throw_if_error(validate(options));
    pages_per_chunk_ = std::max<std::int64_t>(
        1, static_cast<std::int64_t>(options.chunk_bytes / options.page_bytes));
    chunk_alloc_bytes_ = static_cast<std::size_t>(pages_per_chunk_) * options.page_bytes;
    status s = status::success;
    try {
      s = reserve(options.reserve_pages);
    } catch (...) {  // building a reason can throw bad_alloc: do not leak the chunks
      release_chunks();
      throw;
    }
    if (s != status::success) {
      release_chunks();
      throw error(s, last_error());
    }
  }

  /// Returns every chunk to the resource. Pages still in use are released
  /// with it: the cache that used them must be gone (or its work queued on
  /// the pool's stream) by now.
  ~page_pool() { release_chunks(); }

  // Move-only: the chunks have one owner. A moved-from pool is empty and
  // still usable (it keeps the resource and the options).
  page_pool(const page_pool&) = delete;
  page_pool& operator=(const page_pool&) = delete;
  page_pool(page_pool&& other) noexcept
      : resource_(other.resource_),
        options_(other.options_),
        pages_per_chunk_(other.pages_per_chunk_),
        chunk_alloc_bytes_(other.chunk_alloc_bytes_),
        chunks_(std::move(other.chunks_)),
        state_(std::move(other.state_)),
        free_(std::move(other.free_)),
        pages_used_(std::exchange(other.pages_used_, 0)),
        peak_pages_used_(std::exchange(other.peak_pages_used_, 0)) {
    other.forget_pages();
  }
  page_pool& operator=(page_pool&& other) noexcept {
    if (this != &other) {
      release_chunks();
      resource_ = other.resource_;
      options_ = other.options_;
      pages_per_chunk_ = other.pages_per_chunk_;
      chunk_alloc_bytes_ = other.chunk_alloc_bytes_;
      chunks_ = std::move(other.chunks_);
      state_ = std::move(other.state_);
      free_ = std::move(other.free_);
      pages_used_ = std::exchange(other.pages_used_, 0);
      peak_pages_used_ = std::exchange(other.peak_pages_used_, 0);
      other.forget_pages();
    }
    return *this;
  }

  /// Fills `out` with distinct free pages and marks them in use; all or
  /// nothing. Grows by whole chunks when the free list runs short. On failure
  /// returns status::out_of_memory (status::cuda_error when the resource
  /// reports a broken CUDA context) with the reason in last_error(), and
  /// `out` holds only kInvalidPage; chunks obtained before the failure stay
  /// in the pool as free pages.
  [[nodiscard]] status allocate(std::span<page_id> out) {
    std::fill(out.begin(), out.end(), kInvalidPage);
    if (out.empty()) return status::success;
    if (out.size() > free_.size()) {
      if (out.size() > static_cast<std::size_t>(kMaxPages))
        return fail(status::out_of_memory,
                    "page_pool: cannot allocate " + std::to_string(out.size()) +
                        " pages: page ids are int32, so a pool holds at most " +
                        std::to_string(max_pages_by_ids()) + " pages");
      HISPARSE_TRY(grow_to(pages_used_ + static_cast<std::int64_t>(out.size()),
                           "allocating " + std::to_string(out.size()) + " pages"));
    }
    for (page_id& id : out) {
      id = free_.back();
      free_.pop_back();
      state_[static_cast<std::size_t>(id)] = kUsed;
    }
    pages_used_ += static_cast<std::int64_t>(out.size());
    peak_pages_used_ = std::max(peak_pages_used_, pages_used_);
    return status::success;
  }

  /// Returns `pages` to the free list. Every id is checked first (in range,
  /// in use, not repeated within the call); if any fails, returns
  /// status::invalid_argument naming it and frees nothing.
  [[nodiscard]] status deallocate(std::span<const page_id> pages) {
    // Mark as we check, so a repeated id finds its own mark: duplicates are
    // caught in O(n) without a scratch set. On failure, undo the marks.
    for (std::size_t i = 0; i < pages.size(); ++i) {
      const page_id id = pages[i];
      const char* problem = nullptr;
      if (id < 0 || id >= pages_total())
        problem = "is out of range";
      else if (state_[static_cast<std::size_t>(id)] == kMarked)
        problem = "appears more than once in the call";
      else if (state_[static_cast<std::size_t>(id)] == kFree)
        problem = "is not in use (freed twice, or never allocated)";
      if (problem != nullptr) {
        for (std::size_t j = 0; j < i; ++j) state_[static_cast<std::size_t>(pages[j])] = kUsed;
        return fail(status::invalid_argument,
                    "page_pool::deallocate: page id " + std::to_string(id) + " (index " +
                        std::to_string(i) + ") " + problem + "; the pool holds pages [0, " +
                        std::to_string(pages_total()) + "); nothing was freed");
      }
      state_[static_cast<std::size_t>(id)] = kMarked;
    }
    // free_ has capacity for every page (add_chunk reserves it), so this
    // loop cannot allocate or throw.
    for (const page_id id : pages) {
      state_[static_cast<std::size_t>(id)] = kFree;
      free_.push_back(id);
    }
    pages_used_ -= static_cast<std::int64_t>(pages.size());
    return status::success;
  }

  /// Grows by whole chunks until pages_total() >= pages.
  [[nodiscard]] status reserve(std::int64_t pages) {
    if (pages < 0)
      return fail(status::invalid_argument, "page_pool::reserve: pages must be non-negative (got " +
                                                std::to_string(pages) + ")");
    return grow_to(pages, "reserving " + std::to_string(pages) + " pages");
  }

  /// Base address of a page, in use or not (a device pointer for device
  /// resources). Page ids of chunk c are [c * pages_per_chunk(), (c + 1) *
  /// pages_per_chunk()). Throws hisparse::error(invalid_argument) for an id
  /// outside [0, pages_total()).
  [[nodiscard]] std::byte* address(page_id id) const {
    if (id < 0 || id >= pages_total())
      throw error(status::invalid_argument, "page_pool::address: page id " + std::to_string(id) +
                                                " is out of range [0, " +
                                                std::to_string(pages_total()) + ")");
    const std::int64_t chunk = id / pages_per_chunk_, slot = id % pages_per_chunk_;
    return chunks_[static_cast<std::size_t>(chunk)] +
           static_cast<std::size_t>(slot) * options_.page_bytes;
  }

  /// Whether `id` is currently handed out (false for ids out of range).
  [[nodiscard]] bool in_use(page_id id) const {
    return id >= 0 && id < pages_total() && state_[static_cast<std::size_t>(id)] == kUsed;
  }

  [[nodiscard]] std::size_t page_bytes() const noexcept { return options_.page_bytes; }
  [[nodiscard]] std::int64_t pages_per_chunk() const noexcept { return pages_per_chunk_; }
  [[nodiscard]] std::int64_t pages_total() const noexcept {
    return static_cast<std::int64_t>(chunks_.size()) * pages_per_chunk_;
  }
  [[nodiscard]] std::int64_t pages_used() const noexcept { return pages_used_; }
  [[nodiscard]] std::int64_t pages_free() const noexcept { return pages_total() - pages_used_; }

  /// All counters; the free-run scan makes this O(pages), so callers on a hot
  /// path use pages_used() / pages_free() instead.
  [[nodiscard]] page_pool_stats stats() const {
    page_pool_stats s;
    s.pages_total = pages_total();
    s.pages_used = pages_used_;
    s.pages_free = s.pages_total - pages_used_;
    s.peak_pages_used = peak_pages_used_;
    s.chunks = static_cast<std::int64_t>(chunks_.size());
    s.bytes_reserved = chunks_.size() * chunk_alloc_bytes_;
    for (std::size_t c = 0; c < chunks_.size(); ++c) {
      std::int64_t run = 0;  // runs stop at chunk borders: chunks are not adjacent in memory
      for (std::int64_t k = 0; k < pages_per_chunk_; ++k) {
        const std::size_t id =
            c * static_cast<std::size_t>(pages_per_chunk_) + static_cast<std::size_t>(k);
        run = state_[id] == kFree ? run + 1 : 0;
        s.largest_free_run = std::max(s.largest_free_run, run);
      }
    }
    s.fragmentation = s.pages_free == 0 ? 0.0
                                        : 1.0 - static_cast<double>(s.largest_free_run) /
                                                    static_cast<double>(s.pages_free);
    return s;
  }

  [[nodiscard]] Resource& resource() const noexcept { return *resource_; }

 private:
  enum : std::uint8_t { kFree = 0, kUsed = 1, kMarked = 2 };  // kMarked: only inside deallocate

  [[nodiscard]] static status validate(const page_pool_options& o) {
    if (o.page_bytes == 0)
      return fail(status::invalid_argument,
                  "page_pool_options.page_bytes must be positive (got 0)");
    if (o.page_bytes % mr::kAlignment != 0)
      return fail(status::invalid_argument,
                  "page_pool_options.page_bytes must be a multiple of " +
                      std::to_string(mr::kAlignment) +
                      " (mr::kAlignment) so every page is aligned (got " +
                      std::to_string(o.page_bytes) + ")");
    if (o.chunk_bytes == 0)
      return fail(status::invalid_argument,
                  "page_pool_options.chunk_bytes must be positive (got 0)");
    if (o.chunk_bytes / o.page_bytes > static_cast<std::size_t>(kMaxPages))
      return fail(status::invalid_argument,
                  "page_pool_options.chunk_bytes must hold at most 2^31 - 1 pages (page ids are "
                  "int32; got " +
                      std::to_string(o.chunk_bytes / o.page_bytes) + " pages per chunk)");
    if (o.reserve_pages < 0)
      return fail(status::invalid_argument,
                  "page_pool_options.reserve_pages must be non-negative (got " +
                      std::to_string(o.reserve_pages) + ")");
    return status::success;
  }

  [[nodiscard]] std::int64_t max_pages_by_ids() const noexcept {
    return kMaxPages / pages_per_chunk_ * pages_per_chunk_;
  }

  // Grows to at least `target` pages. Refuses up front, taking nothing, when
  // the id range or max_bytes could never get there.
  [[nodiscard]] status grow_to(std::int64_t target, const std::string& what) {
    if (target <= pages_total()) return status::success;
    const std::string context = "page_pool: " + what + " needs " + std::to_string(target) +
                                " pages in total (" + std::to_string(pages_total()) + " held, " +
                                std::to_string(pages_free()) + " free)";
    if (target > max_pages_by_ids())
      return fail(status::out_of_memory, context + ", but page ids are int32: at most " +
                                             std::to_string(max_pages_by_ids()) + " pages of " +
                                             std::to_string(options_.page_bytes) + " bytes");
    const std::int64_t chunks_needed =
        (target - pages_total() + pages_per_chunk_ - 1) / pages_per_chunk_;
    const std::size_t reserved = chunks_.size() * chunk_alloc_bytes_;
    const std::size_t chunks_allowed =
        (options_.max_bytes - std::min(reserved, options_.max_bytes)) / chunk_alloc_bytes_;
    if (static_cast<std::size_t>(chunks_needed) > chunks_allowed)
      return fail(status::out_of_memory,
                  context + ", but max_bytes (" + std::to_string(options_.max_bytes) + ") allows " +
                      std::to_string(chunks_allowed) + " more chunks of " +
                      std::to_string(chunk_alloc_bytes_) + " bytes and " +
                      std::to_string(chunks_needed) + " are needed");
    while (pages_total() < target) HISPARSE_TRY(add_chunk(context));
    return status::success;
  }

  template <class T>
  static void make_room(std::vector<T>& v, std::size_t n) {
    if (v.capacity() < n) v.reserve(std::max(n, 2 * v.capacity()));  // geometric: O(1) amortized
  }

  [[nodiscard]] status add_chunk(const std::string& context) {
    const std::size_t total = static_cast<std::size_t>(pages_total());
    const std::size_t grown = total + static_cast<std::size_t>(pages_per_chunk_);
    // Bookkeeping first: once the chunk is taken, nothing may throw and leak it.
    try {
      make_room(chunks_, chunks_.size() + 1);
      make_room(state_, grown);
      make_room(free_, grown);
    } catch (const std::bad_alloc&) {
      return fail(status::out_of_memory, context + ": no host memory for the page bookkeeping");
    }
    const std::string chunk_text = "a chunk of " + std::to_string(chunk_alloc_bytes_) + " bytes (" +
                                   std::to_string(pages_per_chunk_) + " pages)";
    void* p = nullptr;
    try {
      p = resource_->allocate(chunk_alloc_bytes_, options_.stream);
    } catch (const error& e) {
      // A broken CUDA context is not something freeing pages would fix: keep its code.
      return fail(e.code() == status::cuda_error ? status::cuda_error : status::out_of_memory,
                  context + ": the resource could not provide " + chunk_text + ": " + e.what());
    } catch (const std::exception& e) {
      return fail(status::out_of_memory,
                  context + ": the resource could not provide " + chunk_text + ": " + e.what());
    } catch (...) {
      return fail(status::out_of_memory,
                  context + ": the resource threw an unknown exception for " + chunk_text);
    }
    if (p == nullptr)
      return fail(status::out_of_memory,
                  context + ": the resource returned null for " + chunk_text +
                      " (a resource must throw instead; mr/resource.hpp)");
    if (reinterpret_cast<std::uintptr_t>(p) % mr::kAlignment != 0) {
      try {
        resource_->deallocate(p, chunk_alloc_bytes_, options_.stream);
      } catch (...) {  // already failing; the misalignment is the error to report
      }
      return fail(status::out_of_memory, context + ": the resource returned " + chunk_text +
                                             " not aligned to " + std::to_string(mr::kAlignment) +
                                             " bytes (mr/resource.hpp requires it)");
    }
    chunks_.push_back(static_cast<std::byte*>(p));
    state_.resize(grown, kFree);
    // Pushed in reverse so the lowest ids of the new chunk come off the stack first.
    for (std::size_t id = grown; id > total; --id) free_.push_back(static_cast<page_id>(id - 1));
    return status::success;
  }

  // A destructor has no caller to report to, so a chunk the resource refuses
  // to take back is dropped here; the resource's own accounting shows it.
  void release_chunks() noexcept {
    for (std::byte* chunk : chunks_) {
      try {
        resource_->deallocate(chunk, chunk_alloc_bytes_, options_.stream);
      } catch (...) {
      }
    }
    forget_pages();
  }

  void forget_pages() noexcept {
    chunks_.clear();
    state_.clear();
    free_.clear();
    pages_used_ = 0;
    peak_pages_used_ = 0;
  }

  Resource* resource_;
  page_pool_options options_;
  std::int64_t pages_per_chunk_ = 1;
  std::size_t chunk_alloc_bytes_ = 0;
  std::vector<std::byte*> chunks_;
  std::vector<std::uint8_t> state_;  // kFree / kUsed per page id
  std::vector<page_id> free_;        // LIFO free list: O(1) per page both ways
  std::int64_t pages_used_ = 0;
  std::int64_t peak_pages_used_ = 0;
};

}  // namespace hisparse::kv
