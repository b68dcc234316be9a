// The reducer: one per replica. Reducers form a ring and all-reduce a buffer in place (net/ring.hpp's
// algorithm; here the transport is CAF messages). Usage: send {ring_atom, right_neighbour} once, then
// request {reduce_atom, step, tensor_view}; the reply {step} comes when every rank holds the sum.
#pragma once
#include <caf/all.hpp>

namespace ringmaster {

caf::behavior reducer(caf::event_based_actor* self, int rank, int size);

}  // namespace ringmaster
