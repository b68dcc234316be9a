// A strand: tasks that must not run at the same time, run without a thread of their own. run(f) runs f
// at once on the calling thread when no other thread is running the strand's tasks, and otherwise
// queues it for the thread that is, which runs it before it lets go. Tasks never overlap and run in the
// order they were queued; a task may call run() on this strand (it is queued) or on another strand.
//
// This is how a ring rank's state is driven from whichever thread has news for it (its replica's, its
// neighbour's, the bridge's): a chunk is added and forwarded by the thread that brought it, with no
// hand-over to another thread, so a hop through the ring costs no wake-up inside a process.
#pragma once
#include <atomic>
#include <deque>
#include <functional>
#include <mutex>

namespace ringmaster::net {

class strand {
 public:
  void run(std::function<void()> f) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(f));
      ++waiting_;
      if (busy_) return;
      busy_ = true;
    }
    run_queued();
  }
  // Runs the queued tasks on this thread, unless another thread is running them (which will).
  void drain() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (busy_ || tasks_.empty()) return;
      busy_ = true;
    }
    run_queued();
  }
  // Queues f without running anything on this thread. Returns true when no thread runs the strand's
  // tasks now: the caller must then have one call run() or drain() soon, or f waits.
  bool post(std::function<void()> f) {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back(std::move(f));
    ++waiting_;
    return !busy_;
  }
  // Whether tasks are queued (run or not): a cheap look, without the lock, for a thread that spins.
  bool waiting() const { return waiting_.load() > 0; }

 private:
  void run_queued() {
    for (;;) {
      std::function<void()> t;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (tasks_.empty()) {
          busy_ = false;
          return;
        }
        t = std::move(tasks_.front());
        tasks_.pop_front();
        --waiting_;
      }
      try {
        t();
      } catch (...) {
        // A task reports its own errors; one that throws anyway must not leave the strand busy forever.
      }
    }
  }

  mutable std::mutex mu_;
  std::deque<std::function<void()>> tasks_;
  bool busy_ = false;
  std::atomic<size_t> waiting_{0};  // tasks_.size()
};

}  // namespace ringmaster::net
