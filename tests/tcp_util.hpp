// Helpers of the TCP link tests (test_tcp_link.cpp: messages, strangers, altered frames; test_tcp_abort.cpp:
// senders dropped or aborted while they connect or look a name up): keys, headers, payloads, a listener.
#pragma once
#include <dlfcn.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <cerrno>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "net/tcp_link.hpp"
#include "tests/payload_util.hpp"
#include "tests/test_util.hpp"

namespace ringmaster::tcp_test {

inline constexpr uint64_t kJob = 77;
inline constexpr uint32_t kSender = 1;

inline net::seal_key key_of(unsigned char fill) {
  net::seal_key k;
  k.fill(fill);
  return k;
}

inline wire::header chunk_header(int64_t step, size_t floats) {
  wire::header h;
  h.type = wire::msg_type::chunk;
  h.job_id = kJob;
  h.step = step;
  h.sender_rank = 3;
  h.elements = floats;
  return h;
}

using test::floats_of;


// A socket listening on a free loopback port (its number in *port) with this backlog.
inline int loopback_listener(int backlog, int* port) {
  const int l = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(listen(l, backlog) == 0);
  socklen_t len = sizeof a;
  REQUIRE(getsockname(l, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  *port = ntohs(a.sin_port);
  return l;
}


}  // namespace ringmaster::tcp_test
