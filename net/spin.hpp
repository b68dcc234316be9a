// The loop a thread that waits for a ring runs when it takes a link's messages itself (a poller,
// net/shm_link.hpp and net/tcp_link.hpp): take what is there, spinning, until done() or a deadline.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>

namespace ringmaster::net {

// A spinning thread's hint to the core (and to its hyperthread twin).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// take(): 1 a message was handed on, 0 none is there, -1 the link is gone. done() is asked after each
// message and, when none comes, every `every` empty looks (a power of two): the end may come from another
// thread too. Returns done()'s last answer; stops at `until` or when `stop` is set.
template <class Take>
bool spin_taking(Take&& take, const std::function<bool()>& done, std::chrono::steady_clock::time_point until,
                 const std::atomic<bool>& stop, uint32_t every) {
  bool finished = done();
  for (uint32_t idle = 0; !finished && !stop.load(std::memory_order_relaxed);) {
    const int n = take();
    if (n < 0) break;
    if (n > 0) {
      finished = done();
      continue;
    }
    if ((++idle & (every - 1)) == 0 && ((finished = done()) || std::chrono::steady_clock::now() >= until)) break;
    cpu_relax();
  }
  return finished;
}

}  // namespace ringmaster::net
