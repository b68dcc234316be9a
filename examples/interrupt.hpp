// Ctrl-C for a launcher: a job stopped by SIGINT, SIGTERM or SIGHUP ends cleanly (nodes are told to drop
// it now, not seconds later when they miss our heartbeats; replicas here stop after their step), the
// program reports where to go on from, and then the signal ends it, as a shell expects of a process it
// interrupted (130 for Ctrl-C; a loop around it stops too). A second signal, a second or more after the
// first, ends the program at once; one within a second (a hasty double tap) is taken as the same.
//
//   return examples::train_interruptibly(cfg, [](const train_config& c) { return train(c); },
//                                        [](const train_result& r) { return report(r); });
//
// One program, one handler: include this from the file that holds main().
#pragma once
#include <signal.h>
#include <time.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <functional>
#include <vector>

#include "actors/training.hpp"

namespace ringmaster::examples {

// The signal that interrupted the job (train_config::interrupt), set by its handler: a handler can
// reach nothing else.
inline std::atomic<int> interrupt_signal{0};
static_assert(std::atomic<int>::is_always_lock_free, "a signal handler may only touch lock-free atomics");

// When the first came (CLOCK_MONOTONIC, ms): a second within a second is a double tap of Ctrl-C, which
// must not end us before the nodes are told.
inline std::atomic<long long> interrupt_ms{0};
static_assert(std::atomic<long long>::is_always_lock_free, "a signal handler may only touch lock-free atomics");

inline void on_interrupt(int sig) {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);  // async-signal-safe
  const long long ms = now.tv_sec * 1000LL + now.tv_nsec / 1000000;
  if (interrupt_signal.exchange(sig) == 0) return void(interrupt_ms.store(ms));
  if (ms - interrupt_ms.load() < 1000) return;
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

// Runs train(c) with on_interrupt catching the signals, but not one the caller ignores (SIGHUP under
// nohup, SIGINT in a background job of a script). Afterwards (the summary, --save) signals end us as
// before; finish(result) reports the job (an interrupted one too: train_result::interrupted) and gives
// the exit status, and then the signal ends us. Also a signal that came as the job was ending anyway: it
// finished, and is reported, but a loop around us must still stop.
template <class Train>
int train_interruptibly(train_config& c, Train train, const std::function<int(const train_result&)>& finish) {
  c.interrupt = &interrupt_signal;
  std::vector<int> caught;
  for (int sig : {SIGINT, SIGTERM, SIGHUP})
    if (struct sigaction was {}; sigaction(sig, nullptr, &was) == 0 && was.sa_handler != SIG_IGN) {
      std::signal(sig, on_interrupt);
      caught.push_back(sig);
    }
  const train_result r = train(c);
  for (int sig : caught) std::signal(sig, SIG_DFL);
  const int status = finish(r);
  if (const int sig = r.interrupted ? r.interrupted : interrupt_signal.load()) std::fflush(nullptr), std::raise(sig);
  return status;
}

}  // namespace ringmaster::examples
