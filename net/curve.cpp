#include "net/curve.hpp"

#include <cstring>
#include <vector>

#include "net/keys.hpp"

namespace ringmaster::net {

zap_handler::zap_handler(zmq::context_t& ctx) : socket_(ctx, zmq::socket_type::rep) {
  socket_.set(zmq::sockopt::linger, 0);
  socket_.bind("inproc://zeromq.zap.01");
  fd_ = socket_.get(zmq::sockopt::fd);
}

void zap_handler::serve(const decide& d) {
  for (;;) {
    std::vector<zmq::message_t> req;
    try {
      zmq::message_t m;
      if (!socket_.recv(m, zmq::recv_flags::dontwait)) return;
      for (req.push_back(std::move(m)); req.back().more() && req.size() < 16;) {
        zmq::message_t more;
        if (!socket_.recv(more, zmq::recv_flags::none)) break;
        req.push_back(std::move(more));
      }
    } catch (const zmq::error_t&) {
      return;
    }
    // version, request id, domain, address, routing id, mechanism, credentials (the 32-byte key)
    verdict v{"400", "not authorized"};
    request r;
    const bool curve = req.size() >= 7 && req[5].to_string_view() == "CURVE" && req[6].size() == 32;
    const bool null = req.size() >= 6 && req[5].to_string_view() == "NULL";
    if (req.size() >= 6 && req[0].to_string_view() == "1.0" && (curve || null)) {
      if (null) {
        r.null = true;
      } else {
        char z85[kKeyChars + 1];
        zmq_z85_encode(z85, req[6].data<uint8_t>(), 32);
        r.key = z85;
      }
      r.address = req[3].to_string();
      try {
        v = d(r);
      } catch (...) {
        v = {"500", "internal error"};
      }
    }
    const std::string id = req.size() > 1 ? req[1].to_string() : "";
    const std::string user = v.status == "200" ? r.key : "";  // empty for a NULL client
    try {
      socket_.send(zmq::buffer(std::string_view("1.0")), zmq::send_flags::sndmore);
      socket_.send(zmq::buffer(id), zmq::send_flags::sndmore);
      socket_.send(zmq::buffer(v.status), zmq::send_flags::sndmore);
      socket_.send(zmq::buffer(v.text), zmq::send_flags::sndmore);
      socket_.send(zmq::buffer(user), zmq::send_flags::sndmore);
      socket_.send(zmq::message_t(), zmq::send_flags::none);
    } catch (const zmq::error_t&) {
      return;
    }
  }
}

std::unique_ptr<socket_monitor> socket_monitor::attach(zmq::context_t& ctx, zmq::socket_t& watched,
                                                       const std::string& name, int events) {
  if (zmq_socket_monitor(watched.handle(), name.c_str(), events) != 0) return nullptr;
  zmq::socket_t pair(ctx, zmq::socket_type::pair);
  pair.set(zmq::sockopt::linger, 0);
  pair.connect(name);
  return std::unique_ptr<socket_monitor>(new socket_monitor(std::move(pair)));
}

socket_monitor::socket_monitor(zmq::socket_t pair) : pair_(std::move(pair)), fd_(pair_.get(zmq::sockopt::fd)) {}

void socket_monitor::drain(const std::function<void(uint16_t, uint32_t)>& f, int max) {
  for (int n = 0; n < max; ++n) {
    zmq::message_t event, address;  // libzmq 4.3: (u16 event, u32 value), then the endpoint
    try {
      if (!pair_.recv(event, zmq::recv_flags::dontwait)) return;
      if (event.more()) (void)pair_.recv(address, zmq::recv_flags::none);
    } catch (const zmq::error_t&) {
      return;
    }
    if (event.size() < 6) continue;
    uint16_t what = 0;
    uint32_t value = 0;
    std::memcpy(&what, event.data(), 2);
    std::memcpy(&value, static_cast<const char*>(event.data()) + 2, 4);
    f(what, value);
  }
}

}  // namespace ringmaster::net
