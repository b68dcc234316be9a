// The reducer: one per replica. Reducers form a ring and all-reduce a buffer in place (net/ring.hpp's
// algorithm; here the transport is CAF messages). Usage: send {ring_atom, right, right_is_local, left}
// once (left: the left neighbour when it runs in this process, else a null actor; {ring_atom, right}
// alone: a right neighbour that needs copies, e.g. a link to another node), then request
// {reduce_atom, step, tensor_view}; the reply {step} comes when every rank holds the sum and no
// neighbour still reads the buffer.
#pragma once
#include <caf/all.hpp>

namespace ringmaster {

caf::behavior reducer(caf::event_based_actor* self, int rank, int size);

}  // namespace ringmaster
