// A parallel-for whose caller never waits for a thread that has not started.
//
// at::parallel_for (OpenMP underneath) splits [begin, end) into one fixed range per thread and ends
// in a barrier: when another process holds a core (a co-located client, the API process, a second
// tenant), the descheduled thread's range waits for that thread's next time slice, at each of a
// decode step's ~200 parallel regions. Measured on the 2-core machine (docs/benchmarks.md,
// 2026-12-02): a batch-1 decode step of 15 ms quiet took 27-30 ms beside one busy loop with 2 threads,
// against 16-18 ms with 1 thread.
//
// Here the range is cut into up to 4 chunks per thread that threads claim from one counter (dynamic
// work division, as OpenMP's schedule(dynamic)). The caller takes chunks too, and then waits only for
// chunks already claimed, not for every thread to arrive: a worker that wakes after the last chunk
// was claimed finds nothing and goes back to waiting. So a descheduled worker costs at most the
// chunk it holds, and with no worker at all the caller runs the whole range, as with one thread.
// A worker that loses its core while it holds a chunk still stalls the caller for the rest of the
// other process's time slice (ms); when the caller sees two such waits close together it runs the
// next 2,000 jobs (~10 decode steps) alone and then tries its workers again (note_wait).
//
// The chunks are a division of work, never of arithmetic: every call site's body computes each
// output element by the same instruction sequence whatever range it is given (the kernels' batch
// invariance rule), so results do not depend on the number of threads or on which thread ran what.
//
// Workers spin a short while for the next job (~the gap between two regions of a step, as
// GOMP_SPINCOUNT=1000 for OpenMP) and then sleep on a condition variable. The pool has
// at::get_num_threads() - 1 workers, re-created when that changes. A call from inside a job (a
// nested region) runs serially in the calling thread. An exception in a chunk is rethrown in the
// caller after the job ends.
//
// WHERE IT RUNS: the model runner turns it on for steps of exactly one token (batch-1 decode) and
// off for larger ones (TINYVLLM_CPU_POOL=auto, the default; 1 = every step, 0 = none; the kernels
// alone, outside an engine, start it on only with TINYVLLM_CPU_POOL=1). Measured on the 2-core Zen 4
// machine (docs/benchmarks.md, "A parallel pool for shared cores"): beside a busy loop it takes a
// batch-1 decode step from 32 to 18.5-21 ms, but in every step over HTTP the run-alone rule trips on
// the API process's and the client's own CPU use during prefill and concurrency 16, where two
// threads still beat one: agent workload 93.6 s against 58.7 s, c16 162 against 222 output tok/s
// (light client), 145 against 166 (vllm bench serve). Hence batch-1 steps only.
#pragma once

#include <ATen/Parallel.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <vector>

namespace tv_pool {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

class Pool {
 public:
  static Pool& get() {
    static Pool* p = new Pool();  // never destroyed: workers may still be parked at exit
    return *p;
  }

  template <typename F>
  void run(int64_t begin, int64_t end, int64_t grain, const F& f) {
    if (!enabled_.load(std::memory_order_relaxed)) {
      at::parallel_for(begin, end, grain, f);
      return;
    }
    const int64_t n = end - begin;
    if (n <= 0) return;
    const int64_t nthreads = at::get_num_threads();
    grain = std::max<int64_t>(grain, 1);
    if (nthreads <= 1 || n <= grain || in_job_ || at::in_parallel_region()) {
      f(begin, end);
      return;
    }
    std::lock_guard<std::mutex> caller(call_mu_);  // one job at a time (callers from two threads)
    ++jobs_;
    if (solo_left_ > 0) {  // a worker was found descheduled lately: run alone for a while
      --solo_left_;
      ++solo_jobs_;
      InJob guard;
      f(begin, end);
      return;
    }
    ensure_workers(nthreads - 1);
    const int64_t units = (n + grain - 1) / grain;  // chunk boundaries fall on multiples of grain
    const int64_t nchunks = std::min<int64_t>(units, 4 * nthreads);
    std::function<void(int64_t, int64_t)> body = [&](int64_t b, int64_t e) { f(b, e); };
    // Close the counter (new epoch, claims refused) before the job's fields change: a worker still
    // holding the previous epoch's counter value then fails its claim instead of reading them.
    const uint64_t ep = ((counter_.load() >> 32) + 1) & kClosed;  // 32 bits: wraps after 2^32 jobs
    counter_.store((ep << 32) | kClosed);
    body_.store(&body, std::memory_order_relaxed);
    begin_.store(begin, std::memory_order_relaxed);
    end_.store(end, std::memory_order_relaxed);
    grain_.store(grain, std::memory_order_relaxed);
    units_.store(units, std::memory_order_relaxed);
    nchunks_.store(nchunks, std::memory_order_relaxed);
    done_.store(0);
    error_ = nullptr;
    counter_.store(ep << 32);
    {
      std::lock_guard<std::mutex> lk(mu_);
      epoch_.store(ep);
    }
    cv_.notify_all();
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t own = [&] {
      InJob guard;
      return work(ep);  // catches the chunks' exceptions
    }();
    std::chrono::steady_clock::time_point t1{};
    for (int spins = 0; done_.load(std::memory_order_acquire) < nchunks; ++spins) {
      if (spins == 0) t1 = std::chrono::steady_clock::now();
      if (spins < 4096) cpu_relax(); else std::this_thread::yield();
    }
    counter_.store((ep << 32) | kClosed);
    if (t1.time_since_epoch().count() != 0) note_wait(t0, t1, own);
    if (error_) std::rethrow_exception(error_);
  }

  bool set_enabled(bool on) {
    return enabled_.exchange(on);
  }

  // (jobs run, jobs run alone after a late worker, late-worker events) since the start.
  std::tuple<int64_t, int64_t, int64_t> stats() const { return {jobs_, solo_jobs_, late_events_}; }

 private:
  static constexpr uint64_t kClosed = 0xFFFFFFFFull;

  // Marks this thread as inside a job for its scope: a nested call runs serially.
  struct InJob {
    InJob() { in_job_ = true; }
    ~InJob() { in_job_ = false; }
  };

  Pool() {
    const char* v = std::getenv("TINYVLLM_CPU_POOL");
    enabled_.store(v && std::strcmp(v, "1") == 0);  // off by default: see the measurements above
  }

  // The caller ran out of chunks at t1 (it began at t0 and ran `own` of them) and then waited for
  // chunks that workers had claimed. A wait longer than two of its own chunks and than 300 us means
  // a worker lost its core in the middle of one (a scheduler time slice is ms). Two such waits within
  // 500 jobs (~3 decode steps) mean another process wants the core: the caller then runs the next
  // kSoloJobs jobs alone (~10 decode steps, as with one thread) and then tries its workers again.
  // One wait alone (a hypervisor or interrupt hiccup on a quiet machine) changes nothing.
  void note_wait(std::chrono::steady_clock::time_point t0, std::chrono::steady_clock::time_point t1, int64_t own) {
    const auto waited = std::chrono::steady_clock::now() - t1;
    const auto per_chunk = (t1 - t0) / std::max<int64_t>(own, 1);
    if (waited > 2 * per_chunk && waited > std::chrono::microseconds(300)) {
      ++late_events_;
      if (jobs_ - last_late_ <= 500) solo_left_ = kSoloJobs;
      last_late_ = jobs_;
    }
  }

  // Claim and run chunks of epoch ep until none is left; returns how many this thread ran.
  int64_t work(uint64_t ep) {
    int64_t ran = 0;
    for (;;) {
      uint64_t v = counter_.load();
      if ((v >> 32) != ep || (v & kClosed) == kClosed) return ran;
      const int64_t c = static_cast<int64_t>(v & kClosed);
      // The fields are this epoch's once the claim succeeds (run rewrites them only while closed).
      if (c >= nchunks_.load(std::memory_order_relaxed)) return ran;
      if (!counter_.compare_exchange_weak(v, v + 1)) continue;
      const int64_t nc = nchunks_.load(std::memory_order_relaxed), u = units_.load(std::memory_order_relaxed);
      const int64_t b0 = begin_.load(std::memory_order_relaxed), g = grain_.load(std::memory_order_relaxed);
      const int64_t b = b0 + c * u / nc * g;
      const int64_t e = std::min<int64_t>(end_.load(std::memory_order_relaxed), b0 + (c + 1) * u / nc * g);
      try {
        (*body_.load(std::memory_order_relaxed))(b, e);
      } catch (...) {
        std::lock_guard<std::mutex> lk(err_mu_);
        if (!error_) error_ = std::current_exception();
      }
      ++ran;
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void worker_loop(int64_t generation) {
    in_job_ = true;  // a nested call from a chunk runs serially
    uint64_t seen = epoch_.load();
    for (;;) {
      uint64_t ep;
      int spins = 0;
      while ((ep = epoch_.load(std::memory_order_acquire)) == seen && spins < kSpin) {
        cpu_relax();
        ++spins;
      }
      if (ep == seen) {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return epoch_.load() != seen || generation_.load() != generation; });
        ep = epoch_.load();
      }
      if (generation_.load() != generation) return;
      seen = ep;
      work(ep);
    }
  }

  void ensure_workers(int64_t want) {
    if (static_cast<int64_t>(workers_.size()) == want) return;
    {
      std::lock_guard<std::mutex> lk(mu_);
      generation_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
    const int64_t gen = generation_.load();
    for (int64_t i = 0; i < want; ++i) workers_.emplace_back([this, gen] { worker_loop(gen); });
  }

  // ~50 us of _mm_pause on current x86 (the gap between two parallel regions of a decode step).
  static constexpr int kSpin = 2000;

  static constexpr int64_t kSoloJobs = 2000;

  std::atomic<bool> enabled_{false};
  int64_t jobs_ = 0, solo_jobs_ = 0, late_events_ = 0, solo_left_ = 0;
  int64_t last_late_ = -1000000;  // under call_mu_
  std::mutex call_mu_, mu_, err_mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<uint64_t> counter_{kClosed};
  std::atomic<int64_t> done_{0};
  std::atomic<int64_t> generation_{0};
  std::atomic<std::function<void(int64_t, int64_t)>*> body_{nullptr};
  std::atomic<int64_t> begin_{0}, end_{0}, grain_{1}, units_{0}, nchunks_{0};
  std::exception_ptr error_;
  std::vector<std::thread> workers_;
  static inline thread_local bool in_job_ = false;
};

// Drop-in for at::parallel_for(begin, end, grain, f) with the semantics above.
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  Pool::get().run(begin, end, grain, f);
}

}  // namespace tv_pool
