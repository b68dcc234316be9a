// The floor under a ring all-reduce over TCP on this machine (allreduce_bench --compare floor): the
// ring's schedule over bare loopback TCP connections and nothing else.
//
// `ranks` threads, one a rank (rank r on CPU r mod CPUs with `pin`, as the bench pins its workers), rank
// r connected to rank r+1. Each of the 2(N-1) steps of one all-reduce sends bytes/N to the next rank while
// it receives as many from the one before, pipelined as finely as the ring's data dependency allows (byte
// j of a step goes once byte j of the step before is in; the ring's segments are coarser). No adds, no
// headers, no checks, no wake-ups (each rank spins on its own two sockets, as MPI's TCP path and our ring
// link's poller do): what the kernel's copies alone cost. Timed as the bench times: after a barrier,
// `iters` all-reduces back to back; the slowest rank's time per one.
//
// Why: over loopback every byte is copied into the kernel and out again on the same few cores, so the
// figure our link reaches must be read against what TCP alone reaches here, in the same run.
#pragma once
#include <cstddef>
#include <string>

namespace ringmaster::tools {

// Seconds per all-reduce of `bytes`; a negative value with *error when a socket could not be set up.
double tcp_ring_floor(int ranks, size_t bytes, int iters, int warmup, bool pin, std::string* error);

}  // namespace ringmaster::tools
