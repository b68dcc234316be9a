// Internal to net/tcp_link.cpp and net/tcp_sender.cpp: what both sides of a ring port's TCP link share.
#pragma once
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>

#include "net/seal.hpp"
#include "net/wire.hpp"

namespace ringmaster::net::tcp_io {

constexpr size_t kHead = wire::kHeaderSize + kTrailerBytes;  // what comes before a payload

inline void set_nodelay(int fd) {
  int one = 1;  // ring messages go at once: Nagle's wait for more would stall every small all-reduce
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// Wakes a thread that polls the eventfd `fd`.
inline void signal_fd(int fd) {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = write(fd, &one, sizeof one);
}

}  // namespace ringmaster::net::tcp_io
