// The reducer: one per replica. It runs the ring driver (net/ring_driver.hpp) for its rank: the
// schedule, segments, checks and progress live there; the reducer sums where the buffer lives (a GPU's
// stay on it) and runs the all-reduces asked of it one at a time, in order.
//
// The ring state lives in the reducer's port. Any thread may hand the port a chunk (deliver: the left
// neighbour's thread in this process, the bridge thread for another process) or an all-reduce (reduce:
// the replica's thread); the port's strand runs the work at once on that thread, or on the thread already
// running it (or, while the port's replica waits in poll_briefly, on the replica's), so a chunk is added
// and passed on with no hop to a sleeping thread and an all-reduce costs its caller one message back
// when it ends. Every rank must ask for the same all-reduces in the same
// order. One ends when every rank holds the sum and no neighbour still reads the buffer. A message that
// does not fit the ring, or no progress for `timeout`, fails it (and every later one) with a message
// naming the silent or lying neighbour.
//
// The reducer actor looks after the port:
//   {ring_atom, link_ptr right}   join (below), as a message
//   {release_atom, int64_t}       run the port's queued work (what other threads handed over)
// and ticks the watchdog every timeout / 4 (at most a second) while all-reduces are asked for.
#pragma once
#include <caf/all.hpp>
#include <chrono>
#include <functional>
#include <memory>

#include "actors/messages.hpp"

#include "net/ring_driver.hpp"

namespace ringmaster {

struct reducer_config;
class reducer_port;
// The port of the reducer of cfg.rank (cfg.port is ignored); see spawn_reducer.
std::shared_ptr<reducer_port> make_reducer_port(const reducer_config& cfg);
// "" when every rank holds the sum, else why the all-reduce failed. Called on whichever thread ends it.
using reduce_done = std::function<void(const std::string& error)>;
// All-reduces buf[lo, hi), in the element order of the whole buffer (a gradient bucket), after the ones
// asked before. `buf.owner` keeps the buffer alive while neighbours may read it.
void reduce(reducer_port& port, tensor_view buf, size_t lo, size_t hi, reduce_done done);
// Joins the ring: this rank's chunks go through `right` (actors/ring_links.hpp). Before any reduce().
void join(reducer_port& port, std::shared_ptr<ring::link> right);
// Leaves the ring for good: fails what is asked, gives staging buffers back to their backends and drops
// the links. Returns when done (for buffers without an owner, whose backends may go next).
void leave(reducer_port& port);
// Fails the running and every later all-reduce with `why` (a neighbour said the job is over).
void fail(reducer_port& port, const std::string& why);
// Fails them as fail() does because the link from or to `rank` (in another process) closed under a live
// ring: stalled_on() then names that rank and link_broke() says so. An elastic replica leaves the verdict
// to its launcher, as for the watchdog's: a link broken between two live nodes, or a node gone.
void fail_link(reducer_port& port, int rank, const std::string& why);
// The rank an all-reduce waited for when the watchdog failed it (no progress for `timeout`), or whose link
// broke (fail_link); -1 when the port has not failed either way. Any thread, once the failure was heard of.
int stalled_on(const reducer_port& port);
bool link_broke(const reducer_port& port);
// Hands a chunk from the left neighbour to the reducer whose port this is; any thread, no wait for the
// reducer's thread (when this thread is already deep in a chain of such calls, a long ring in one
// process, the chunk is queued in order and the reducer actor runs it).
void deliver(reducer_port& port, ring::message m);

// Takes the left neighbour's messages on the calling thread until done() or `until`, and returns
// done()'s last answer (net/shm_link.hpp's shm_receiver::poll).
using ring_poller = std::function<bool(std::chrono::steady_clock::time_point until, const std::function<bool()>& done)>;
// The port's left link can be polled so, for up to `budget` at a time: set before the ring runs (a
// shared-memory link). A zero budget or an empty poller: never.
void set_poller(reducer_port& port, ring_poller p, std::chrono::microseconds budget);
// For a thread that asked for all-reduces and has nothing else to do (a replica once its next batch is
// in): takes the left neighbour's messages itself, spinning, for up to the poller's budget or until the
// all-reduces have ended. A receiving thread would have to be woken for each message, and the waiting
// thread again at the end: 10-30 us apiece here; a 4 KB all-reduce between processes fell from 41-57 us
// to 3-13. Chunks that other threads bring meanwhile are left to this thread, which has nothing else to
// do. Returns at once without a poller. `done`, if given, says when the caller has heard of the
// end (its own flag, set by the reduce_done it passed), else when the port has no all-reduce left.
void poll_briefly(reducer_port& port, const std::function<bool()>& done = {});
// The poller of a port whose left neighbour is in this process: that neighbour's thread brings the chunks,
// and the waiting thread spins, running them (poll_briefly) until it is done, sparing its own wake-up.
ring_poller spin_until_done();

struct reducer_config {
  int rank = 0, size = 1;
  ring::driver_options ring;  // ring.job: only messages of this job are accepted
  std::chrono::milliseconds timeout{60000};  // longest wait for the neighbours during one all-reduce
  std::shared_ptr<reducer_port> port;  // set by spawn_reducer
};

caf::behavior reducer(caf::event_based_actor* self, reducer_config cfg);
// Spawns a reducer with a port of its own; *out is the actor, the port is returned. The way to make
// one whose port others use (cfg.port is ignored).
std::shared_ptr<reducer_port> spawn_reducer(caf::actor_system& sys, reducer_config cfg, caf::actor* out);

}  // namespace ringmaster
