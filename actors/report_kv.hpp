// The reports a node ships to its launcher (net/wire.hpp). Step reports, one a rank and step, travel as
// binary records, many to a steps message (encode_steps, decode_steps). The rest are key=value text (a
// report message's payload) naming their kind ("kind=eval", "kind=paused": a replica's answer to a pause,
// actors/reform.hpp, "kind=held": its answer to a hold, or "kind=stall": its ring waited too long); the
// rank travels in the header's sender_rank. Doubles travel exactly: as their bits, or as hex floats.
#pragma once
#include <string>
#include <vector>

#include "actors/messages.hpp"
#include "net/wire.hpp"

namespace ringmaster {

// A replica's answer to a hold (a job on nodes stopped by a signal, actors/launcher_stop.cpp): it starts
// no further step, having started `started` (those applied, and one in flight). Generation `gen` is
// the pause that follows.
struct held_report {
  int gen = 0;
  int64_t started = 0;
};

// n records (a steps message's payload, n <= wire::kMaxStepRecords).
std::string encode_steps(const step_report* r, size_t n);
// False with *error naming the first bad record and field (a negative count, a time that is not 0 to a
// year, ...); a loss may be anything, NaN included. `bytes`: 1..kMaxStepRecords whole records.
bool decode_steps(const void* data, size_t bytes, std::vector<step_report>* out, std::string* error);
wire::kv_map to_kv(const eval_report& r);
wire::kv_map to_kv(const pause_report& r);
wire::kv_map to_kv(const held_report& r);
wire::kv_map to_kv(const stall_report& r);
// "eval", "paused", "held", "stall", or "" when the payload names no kind.
std::string report_kind(const wire::kv_map& kv);
// False with *error naming the bad or missing key. The rank is not read (it is the header's).
bool from_kv(const wire::kv_map& kv, eval_report* r, std::string* error);
bool from_kv(const wire::kv_map& kv, pause_report* r, std::string* error);
bool from_kv(const wire::kv_map& kv, held_report* r, std::string* error);
// waiting_for: 0..replicas-1; why: at most 1000 bytes (as sent: show it with node_text()).
bool from_kv(const wire::kv_map& kv, stall_report* r, int replicas, std::string* error);

}  // namespace ringmaster
