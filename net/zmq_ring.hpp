// Ring all-reduce across processes: net/ring.hpp's algorithm with chunks carried by a bridge.
//
// Rank r listens on endpoints[r] and sends to rank r+1. The buffer is cut into pieces of
// size * segment elements and every piece runs its own ring (allreduce_state) at the same time, so each
// message holds one segment (1 MiB by default): while the bridge thread adds one segment, ZeroMQ's I/O
// thread is already receiving the next, and the link never waits for a whole chunk to be summed.
//
// Buffers up to small_bytes (64 KiB) take a latency path instead: each rank's whole buffer is passed
// round the ring (size-1 hops rather than 2(size-1)) and every rank sums the buffers in rank order.
// Either way every rank ends with the same bits.
//
// All ring state lives on the bridge thread (the handler receives a chunk, adds it and sends the next at
// once, no thread hop); the calling thread only starts a step and waits for it. Segments are sent from
// the caller's buffer without a copy (safe: a range is overwritten only after the right neighbour has
// received it, and allreduce returns only once ZeroMQ has let go of every segment).
//
// One allreduce at a time per ring, never from a bridge handler. A dead or stuck neighbour makes the
// call fail after `timeout` without progress, and tells the other ranks (abort) so they fail as well.
// Large all-reduces allocate ZeroMQ receive buffers per segment; glibc's default of returning such
// memory to the OS makes every one of them page-fault afresh. A program may prefer to keep it
// (mallopt M_TRIM_THRESHOLD / M_MMAP_THRESHOLD); a library does not change that for its host.
//
//   zmq_ring ring(rank, size);
//   std::string err;
//   if (!ring.listen(endpoints[rank], &err) || !ring.connect(endpoints, &err)) ...;
//   err = ring.allreduce(grads.data(), grads.size());   // "" or what failed
//
// listen() and connect() are separate so a launcher can bind port 0, publish ring.endpoint() and hand
// out the full list afterwards. Every rank must call allreduce the same number of times with the same
// length. After an error the ring is unusable (each later call returns the error): build a new one.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "net/bridge.hpp"

namespace ringmaster::net {

struct zmq_ring_options {
  uint64_t job_id = 1;                 // ranks of another job are refused at hello
  size_t segment_bytes = size_t(1) << 20;
  // Buffers up to this size skip the ring: each rank's whole buffer is passed round (size-1 hops, half
  // the ring's latency) and every rank sums them in rank order. 0: always the ring.
  size_t small_bytes = 64 * 1024;
  // No progress for this long during an all-reduce (a dead or stuck peer): the call returns an error.
  // A peer that merely starts its all-reduce later than us counts as no progress too: size it to the
  // longest expected skew between ranks.
  std::chrono::milliseconds timeout{5000};
  std::chrono::milliseconds handshake_timeout{30000};
  // allreduce() yields in a loop this long before it sleeps on a condition variable (latency vs CPU).
  std::chrono::microseconds wait_spin{0};
  bridge_options bridge;
  // Messages the ring does not use go here (on the bridge thread): the bridge is the process's only one.
  bridge::message_handler fallback;
  // Invalid frames and other transport errors; default: printed to stderr.
  bridge::error_handler on_error;
};

class zmq_ring {
 public:
  zmq_ring(int rank, int size, zmq_ring_options options = {});
  ~zmq_ring();
  zmq_ring(const zmq_ring&) = delete;
  zmq_ring& operator=(const zmq_ring&) = delete;

  int rank() const;
  int size() const;

  // Binds this rank's endpoint and starts the bridge. endpoint() then gives the real one (port 0).
  bool listen(const std::string& endpoint, std::string* error);
  std::string endpoint() const;
  // Connects to the right neighbour and waits until both neighbours said hello in this protocol version
  // and job (or handshake_timeout). endpoints[rank] is ours and is not dialled.
  bool connect(const std::vector<std::string>& endpoints, std::string* error);
  // listen(endpoints[rank]) then connect(endpoints).
  bool start(const std::vector<std::string>& endpoints, std::string* error);

  // Sums buf[0..len) over all ranks into every rank's buf. Returns "" or what failed. The buffer must
  // not be touched by anyone else until the call returns.
  std::string allreduce(float* buf, size_t len);

  // The bridge, for other messages (send, reply); its handler is the ring's, which passes the rest on to
  // options.fallback.
  bridge& transport();

 private:
  struct impl;
  std::unique_ptr<impl> d_;
};

}  // namespace ringmaster::net
