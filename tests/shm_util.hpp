// Helpers of the shared-memory link tests (test_shm_link.cpp: messages, full buffers, broken senders;
// test_shm_lend.cpp: payloads lent in place and their owners): stamps, inboxes, raw segments.
#pragma once
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "net/shm_link.hpp"
#include "net/shm_window.hpp"
#include "tests/payload_util.hpp"

namespace ringmaster::shm_test {

using namespace std::chrono_literals;

// A stamp no other test run uses (segment names are per user, job and rank).
inline net::shm_stamp fresh_stamp() {
  std::random_device rd;
  return {uint64_t(rd()) << 32 | rd(), 3, 4};
}

inline wire::header chunk_header(const net::shm_stamp& s, int64_t step, size_t floats) {
  wire::header h;
  h.type = wire::msg_type::chunk;
  h.job_id = s.job;
  h.step = step;
  h.sender_rank = s.sender_rank;
  h.elements = floats;
  return h;
}

using test::floats_of;

// What a receiver got, for a test to wait on.
struct inbox {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::pair<wire::header, std::vector<float>>> got;
  std::vector<std::string> errors;

  void start(net::shm_receiver& r) {
    r.start(
        [this](const wire::header& h, net::payload p) {
          std::lock_guard<std::mutex> lock(mu);
          got.emplace_back(h, std::vector<float>(p.floats(), p.floats() + h.elements));
          cv.notify_all();
        },
        [this](const std::string& why) {
          std::lock_guard<std::mutex> lock(mu);
          errors.push_back(why);
          cv.notify_all();
        });
  }
  bool wait_messages(size_t n, std::chrono::milliseconds t = 10s) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, t, [&] { return got.size() >= n; });
  }
  std::string wait_error(std::chrono::milliseconds t = 5s) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, t, [&] { return !errors.empty(); }) ? errors[0] : "";
  }
};


// The segment as a test maps it, to write into it as a broken or hostile sender would. Offsets of the
// control block's fields (net/shm_segment.hpp): head at 64, head_seq at 72; records from 4096.
struct raw_segment {
  void* base = MAP_FAILED;
  size_t bytes = 4096 + net::kShmCapacity;
  explicit raw_segment(const net::shm_stamp& s) {
    const int fd = shm_open(net::shm_name(s).c_str(), O_RDWR, 0);
    REQUIRE(fd >= 0);
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    REQUIRE(base != MAP_FAILED);
  }
  ~raw_segment() { munmap(base, bytes); }
  unsigned char* at(size_t off) { return static_cast<unsigned char*>(base) + off; }
  void set_head(uint64_t head) {
    reinterpret_cast<std::atomic<uint64_t>*>(at(64))->store(head);
    reinterpret_cast<std::atomic<uint32_t>*>(at(72))->fetch_add(1);  // the receiver looks at least every 100 ms
  }
  void record(size_t off, uint64_t len, const wire::header& h) {
    std::memcpy(at(4096 + off), &len, 8);
    const wire::header_bytes hb = wire::encode(h);
    std::memcpy(at(4096 + off + 8), hb.data(), hb.size());
  }
};

// A receiver's segment and the sender on it, not yet started; `map`: the segment as the test maps it
// too (before the sender's open removes its name).
struct pair_link {
  net::shm_stamp stamp = fresh_stamp();
  std::unique_ptr<net::shm_receiver> rx;
  std::unique_ptr<raw_segment> raw;
  std::unique_ptr<net::shm_sender> tx;
  explicit pair_link(bool map = false) {
    std::string error;
    bool missing = false;
    rx = net::shm_receiver::create(stamp, &error);
    REQUIRE(rx);
    if (map) raw = std::make_unique<raw_segment>(stamp);
    tx = net::shm_sender::open(stamp, &error, &missing);
    INFO(error);
    REQUIRE(tx);
  }
};

}  // namespace ringmaster::shm_test
