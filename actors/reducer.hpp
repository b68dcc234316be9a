// The reducer: one per replica. It runs the ring driver (net/ring_driver.hpp) for its rank: the
// schedule, segments, checks and progress live there; the reducer sums where the buffer lives (a GPU's
// stay on it) and answers the requests one at a time, in order.
//
//   {ring_atom, link_ptr right}                 where this rank's chunks go (actors/ring_links.hpp)
//   {reduce_atom, step, tensor_view}            all-reduce the whole buffer; reply {step}
//   {reduce_atom, step, tensor_view, lo, hi}    all-reduce buf[lo, hi) only (a gradient bucket), in the
//                                               element order of the whole buffer; reply {step}
//   {chunk_atom, ring::message}                 from the left neighbour, as a message
//   {ring_atom}                                 leave the ring: staging buffers go back to their backends
//                                               now (buffers without an owner: their backends may go next)
//
// The ring state lives in the reducer's port, which any thread may hand a chunk to (deliver): the
// left neighbour's thread in this process, or the bridge thread for another process. The chunk is then
// added and passed on by that thread at once, with no hop to the reducer's own thread; the reducer hears
// only when an all-reduce is done. Every rank must make the same requests in the same order. A reply
// comes when every rank holds the sum and no neighbour still reads the buffer. A message that does not
// fit the ring, or no progress for `timeout`, fails the request and ends the reducer with a message
// naming the silent or lying neighbour.
#pragma once
#include <caf/all.hpp>
#include <chrono>
#include <memory>

#include "net/ring_driver.hpp"

namespace ringmaster {

class reducer_port;
std::shared_ptr<reducer_port> make_reducer_port();
// Hands a chunk from the left neighbour to the reducer whose port this is; any thread, no wait for the
// reducer's thread. Returns false when this thread is already deep in a chain of such calls (a long
// ring in one process): send it as a {chunk_atom} message instead.
bool deliver(reducer_port& port, ring::message& m);

struct reducer_config {
  int rank = 0, size = 1;
  ring::driver_options ring;  // ring.job: only messages of this job are accepted
  std::chrono::milliseconds timeout{60000};  // longest wait for the neighbours during one all-reduce
  std::shared_ptr<reducer_port> port;  // null: a port of its own (chunks then come as messages)
};

caf::behavior reducer(caf::event_based_actor* self, reducer_config cfg);

}  // namespace ringmaster
