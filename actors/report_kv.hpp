// The step and eval reports a node ships to its launcher, as key=value text (a report message's
// payload, net/wire.hpp). The payload names its kind ("kind=step", "kind=eval", "kind=paused": a
// replica's answer to a pause, actors/reform.hpp, or "kind=stall": its ring waited too long); the rank travels in the header's sender_rank. Doubles
// travel as hex floats: exact.
#pragma once
#include <string>

#include "actors/messages.hpp"
#include "net/wire.hpp"

namespace ringmaster {

wire::kv_map to_kv(const step_report& r);
wire::kv_map to_kv(const eval_report& r);
wire::kv_map to_kv(const pause_report& r);
wire::kv_map to_kv(const stall_report& r);
// "step", "eval", "paused", "stall", or "" when the payload names no kind.
std::string report_kind(const wire::kv_map& kv);
// False with *error naming the bad or missing key. The rank is not read (it is the header's).
bool from_kv(const wire::kv_map& kv, step_report* r, std::string* error);
bool from_kv(const wire::kv_map& kv, eval_report* r, std::string* error);
bool from_kv(const wire::kv_map& kv, pause_report* r, std::string* error);
// waiting_for: 0..replicas-1; why: at most 1000 bytes (as sent: show it with node_text()).
bool from_kv(const wire::kv_map& kv, stall_report* r, int replicas, std::string* error);

}  // namespace ringmaster
