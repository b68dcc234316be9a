// The reducer: one per replica. It runs the ring driver (net/ring_driver.hpp) for its rank: the
// schedule, segments, checks and watchdog live there; the reducer owns the ring's state for its rank,
// sums where the buffer lives (a GPU's stay on it) and answers the requests one at a time, in order.
//
//   {ring_atom, link_ptr right}                 where this rank's chunks go (actors/ring_links.hpp)
//   {reduce_atom, step, tensor_view}            all-reduce the whole buffer; reply {step}
//   {reduce_atom, step, tensor_view, lo, hi}    all-reduce buf[lo, hi) only (a gradient bucket), in the
//                                               element order of the whole buffer; reply {step}
//   {chunk_atom, ring::message}                 from the left neighbour (its link, or a node's router)
//   {ring_atom}                                 leave the ring: staging buffers go back to their backends
//                                               now (buffers without an owner: their backends may go next)
//
// Every rank must make the same requests in the same order. A reply comes when every rank holds the sum
// and no neighbour still reads the buffer. A message that does not fit the ring, or no progress for
// `timeout`, fails the request and ends the reducer with a message naming the silent or lying neighbour.
#pragma once
#include <caf/all.hpp>
#include <chrono>

#include "net/ring_driver.hpp"

namespace ringmaster {

struct reducer_config {
  int rank = 0, size = 1;
  ring::driver_options ring;  // ring.job: only messages of this job are accepted
  std::chrono::milliseconds timeout{60000};  // longest wait for the neighbours during one all-reduce
};

caf::behavior reducer(caf::event_based_actor* self, reducer_config cfg);

}  // namespace ringmaster
