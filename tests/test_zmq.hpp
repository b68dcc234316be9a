// Raw ZeroMQ messages for tests that play a hostile or hand-made peer.
#pragma once
#include <initializer_list>
#include <zmq.hpp>

#include "net/wire.hpp"

namespace ringmaster::test {

// Sends the header frame, then each of `frames` (a payload, a trailer), as one multipart message. The
// header goes as given: a test sets payload_bytes itself, right or wrong.
inline void send_raw(zmq::socket_t& s, const wire::header& h, std::initializer_list<zmq::const_buffer> frames = {}) {
  const auto hb = wire::encode(h);
  s.send(zmq::buffer(hb.data(), hb.size()), frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
  size_t left = frames.size();
  for (const zmq::const_buffer& f : frames) s.send(f, --left ? zmq::send_flags::sndmore : zmq::send_flags::none);
}

}  // namespace ringmaster::test
