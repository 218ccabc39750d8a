// The native products' threads: awake between the products of a decode step, asleep between steps.
//
// A decode step runs a hundred or more products of one row, each a few tens of microseconds of reading,
// back to back with a little Python between them. torch's OpenMP threads sleep at once after each
// (`import shardstream` sets OMP_WAIT_POLICY=PASSIVE, since threads that spin burn the time slices that
// other processes on the machine need), and a product split over them in equal shares ends only when the
// last thread has woken and done its share: every product pays the wake-up. Here the caller and the pool's
// workers take chunks of a product from one counter, so the caller never waits for a thread still waking
// (it takes the chunks itself), and a worker that has just finished keeps looking for the next product for a
// while (kAwake), yielding its core to any other thread that wants it (sched_yield), before it sleeps.
// Which thread computes a chunk does not change its bits: every output is one chunk's sum.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

namespace work_pool {

// How long a worker looks for the next product before it sleeps: longer than the gaps between a decode
// step's products, shorter than a pause between steps.
constexpr auto kAwake = std::chrono::milliseconds(2);

class Pool {
 public:
  // fn(begin, end) over [0, n) in chunks of `chunk` items, by the caller and the workers awake (one fewer
  // than the most threads at::get_num_threads() has said so far); the caller returns when every chunk is
  // done. Run serially where that is one thread or one chunk, or inside an OpenMP region. False, and
  // nothing run, while another thread holds the pool.
  template <class F>
  bool run(int64_t n, int64_t chunk, const F& fn) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    const int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
    const int64_t chunks = (n + chunk - 1) / chunk;
    if (threads <= 1 || chunks <= 1 || chunks > kMask) {
      if (n > 0) fn(0, n);
      return true;
    }
    hire(threads - 1);
    n_ = n;
    chunk_ = chunk;
    context_ = &fn;
    call_ = [](const void* context, int64_t begin, int64_t end) { (*static_cast<const F*>(context))(begin, end); };
    done_.store(0, std::memory_order_relaxed);
    const uint64_t generation = (generation_of(state_.load(std::memory_order_relaxed)) + 1) & kGenerationMask;
    state_.store(generation << kGenerationShift | static_cast<uint64_t>(chunks) << kCountShift);   // seq_cst: see sleep
    if (sleeping_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_);
      wake_.notify_all();
    }
    take(generation);
    for (int spins = 0; done_.load(std::memory_order_acquire) < chunks;)
      if (++spins % 64 == 0) sched_yield(); else _mm_pause();
    return true;
  }

 private:
  static constexpr int kCountShift = 22, kGenerationShift = 44;
  static constexpr uint64_t kMask = (uint64_t{1} << 22) - 1, kGenerationMask = (uint64_t{1} << 20) - 1;

  static uint64_t generation_of(uint64_t state) { return state >> kGenerationShift & kGenerationMask; }

  // Claim chunks of this generation's product until none is left; a chunk is claimed only while the
  // state still names this generation, so a late worker never takes one of the next product's.
  void take(uint64_t generation) {
    uint64_t state = state_.load(std::memory_order_acquire);
    while (generation_of(state) == generation && (state & kMask) < (state >> kCountShift & kMask)) {
      if (state_.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        const int64_t begin = static_cast<int64_t>(state & kMask) * chunk_;   // stable: the caller waits for it
        call_(context_, begin, std::min(n_, begin + chunk_));
        done_.fetch_add(1, std::memory_order_release);
        state = state_.load(std::memory_order_acquire);
      }
    }
  }

  void hire(int workers) {
    while (hired_ < workers) {
      ++hired_;
      std::thread([this] { work(); }).detach();   // the pool lives as long as the process (see pool())
    }
  }

  void work() {
    uint64_t seen = generation_of(state_.load());
    for (;;) {
      auto since = std::chrono::steady_clock::now();
      uint64_t state;
      for (int spins = 0; generation_of(state = state_.load(std::memory_order_acquire)) == seen;) {
        _mm_pause();
        if (++spins % 64) continue;
        sched_yield();
        if (std::chrono::steady_clock::now() - since > kAwake) {
          sleep(seen);
          since = std::chrono::steady_clock::now();
        }
      }
      seen = generation_of(state);
      take(seen);
    }
  }

  // Sleep until a product newer than `seen` is posted. Counted in `sleeping_` before the state is checked
  // again, and the caller posts before it reads `sleeping_` (both sequentially consistent): either the
  // caller sees the sleeper and wakes it, or the sleeper sees the new product and does not sleep.
  void sleep(uint64_t seen) {
    std::unique_lock<std::mutex> lock(sleep_);
    sleeping_.fetch_add(1);
    wake_.wait(lock, [&] { return generation_of(state_.load()) != seen; });
    sleeping_.fetch_sub(1);
  }

  std::mutex busy_;                 // one caller at a time
  std::atomic<uint64_t> state_{0};  // generation (20 bits) | chunks (22) | next chunk to claim (22)
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleeping_{0};
  std::mutex sleep_;
  std::condition_variable wake_;
  int hired_ = 0;
  int64_t n_ = 0, chunk_ = 1;
  const void* context_ = nullptr;
  void (*call_)(const void*, int64_t, int64_t) = nullptr;
};

// The process's pool, made on first use and never destroyed (its workers are detached and end with the
// process); a child forked after it was made gets one of its own (it has none of the parent's threads).
inline Pool& pool() {
  static Pool* made = nullptr;
  static pid_t owner = 0;
  static std::mutex making;
  std::lock_guard<std::mutex> lock(making);
  if (made == nullptr || owner != getpid()) {
    made = new Pool();
    owner = getpid();
  }
  return *made;
}

// Whether the pool is used (`work_pool_use`): not where OpenMP's own threads spin, since on a small CPU the
// two kinds of waiting threads would take each other's cores.
inline std::atomic<bool>& used() {
  static std::atomic<bool> on{false};
  return on;
}

// at::parallel_for for the products of one or a few rows: with the pool, chunks of about a quarter of a
// thread's share, so that the threads awake share what a late one does not take; torch's split where the
// pool is not used or another thread holds it.
template <class F>
void parallel_for(int64_t begin, int64_t end, const F& fn) {
  const int64_t n = end - begin;
  const int64_t chunk = std::max<int64_t>(1, n / (4 * std::max(1, at::get_num_threads())));
  if (!used().load(std::memory_order_relaxed) ||
      !pool().run(n, chunk, [&](int64_t first, int64_t last) { fn(begin + first, begin + last); }))
    at::parallel_for(begin, end, 1, fn);
}

}  // namespace work_pool

// Set by native.py when the library is loaded: 1 where OpenMP's threads sleep between parallel regions.
extern "C" void work_pool_use(int on) { work_pool::used().store(on != 0); }
