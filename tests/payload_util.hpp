// A payload for the link tests (test_shm_link.cpp, test_shm_lend.cpp, test_tcp_link.cpp, test_tcp_abort.cpp).
#pragma once
#include <memory>
#include <vector>

#include "net/bridge.hpp"

namespace ringmaster::test {

// n floats counting up from `first`, so that a message's place and every value in it can be checked.
inline net::payload floats_of(size_t n, float first) {
  auto v = std::make_shared<std::vector<float>>(n);
  for (size_t i = 0; i < n; ++i) (*v)[i] = first + float(i);
  return net::payload::of(v);
}

}  // namespace ringmaster::test
