// A ring all-reduce across processes, one rank per process: the training path on its own. Each rank
// runs a reducer actor (actors/reducer.hpp, the one ring driver) whose chunks go to the next rank through
// the bridge (ZeroMQ, zero-copy) exactly as a node daemon's reducers do; allreduce_bench and the tests
// use it, so what they measure is what training runs.
//
// Rank r listens on endpoints[r] and sends to rank r+1. A handshake checks that both neighbours run
// the same job, ring size and protocol version; afterwards chunks are accepted only from the left
// neighbour's connection. A dead or stuck neighbour fails the call after `timeout` without progress,
// naming it, and the others are told (abort) so they fail as well.
//
//   process_ring ring(rank, size);
//   std::string err;
//   if (!ring.listen(endpoints[rank], &err) || !ring.connect(endpoints, &err)) ...;
//   err = ring.allreduce(grads.data(), grads.size());   // "" or what failed
//
// Over tcp, chunks go on a TCP connection of their own to the right neighbour's ring port
// (net/tcp_link.hpp), as node daemons send them between hosts: plain without keys, sealed with
// AES-128-OCB with keys (options.bridge.keys, the bridge then CurveZMQ, each rank letting in only its
// left neighbour's key) and a seal salt. With keys and no salt (CurveZMQ), or over ipc, or to a
// neighbour that opened no ring port (tcp_link off), they go through the bridge. With shared_memory,
// chunks between ranks on one host go through /dev/shm.
//
// listen() and connect() are separate so a launcher can bind port 0, publish endpoint() and hand out
// the full list afterwards. Every rank calls allreduce the same number of times with the same length.
// After an error the ring is unusable (each later call returns the error): build a new one.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "net/bridge.hpp"

namespace ringmaster {

struct process_ring_options {
  uint64_t job_id = 1;  // ranks of another job are refused at hello
  size_t segment_bytes = size_t(1) << 20;
  size_t small_bytes = 64 * 1024;  // buffers up to this size take the ring driver's small-buffer path
  std::chrono::milliseconds timeout{5000};  // no progress this long during an all-reduce: it fails
  std::chrono::milliseconds handshake_timeout{30000};
  int threads = 2;  // the actor system's
  net::bridge_options bridge;  // with keys: CurveZMQ (bridge.authorize is set to the left neighbour's key)
  // With keys: rank r's public key is public_keys[r] (empty: every rank holds bridge.keys, a shared key
  // directory). seal_salt (net/seal.hpp, the same on every rank): chunks sealed with AES-128-OCB.
  std::vector<std::string> public_keys;
  std::string seal_salt;
  // Over tcp (without keys, or with a seal salt): a ring port, where the left neighbour sends chunks on a
  // TCP connection of its own. false: none, so chunks come through the bridge (ZeroMQ), for comparison
  // (not with a seal salt: sealed chunks go to ring ports only).
  bool tcp_link = true;
  // Ranks on one host, as one user, pass chunks through shared memory (net/shm_link.hpp), as node daemons
  // do; the bridge still carries the handshake and aborts. A rank that finds no segment of its right
  // neighbour's (another host) sends over the bridge.
  bool shared_memory = false;
  // allreduce() takes the chunks that come through shared memory on its own thread, spinning, for up
  // to this long (actors/reducer.hpp, poll_briefly); 0: it sleeps until the receiving thread is done.
  std::chrono::microseconds poll{300};
  net::bridge::error_handler on_error;  // invalid frames and dropped chunks; default: stderr
};

class process_ring {
 public:
  process_ring(int rank, int size, process_ring_options options = {});
  ~process_ring();
  process_ring(const process_ring&) = delete;
  process_ring& operator=(const process_ring&) = delete;

  int rank() const;
  int size() const;
  bool listen(const std::string& endpoint, std::string* error);
  std::string endpoint() const;
  // After connect: whether chunks to the right neighbour go through shared memory (shared_memory, and a
  // segment of the right neighbour's found on this host).
  bool through_shared_memory() const;
  bool connect(const std::vector<std::string>& endpoints, std::string* error);
  bool start(const std::vector<std::string>& endpoints, std::string* error);  // listen, then connect
  // With shared_memory: `floats` floats for allreduce() buffers, kept as long as the ring, which the
  // right neighbour on this host reads where they are instead of receiving a copy, as node daemons lend
  // their replicas' gradients (net/shm_window.hpp). Once per ring. nullptr with *error when there is
  // no such memory; any buffer works with allreduce() all the same.
  float* shared_buffer(size_t floats, std::string* error);
  // Whether the right neighbour has mapped shared_buffer()'s memory and read chunks of it in place.
  bool buffer_read_in_place() const;
  // Sums buf[0..len) over all ranks into every rank's buf. "" or what failed. Nobody else may touch the
  // buffer until the call returns.
  std::string allreduce(float* buf, size_t len);

 private:
  struct impl;
  std::unique_ptr<impl> d_;
};

}  // namespace ringmaster
