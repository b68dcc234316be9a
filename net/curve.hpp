// CurveZMQ's plumbing for the bridge (net/bridge.cpp), used on its thread only: the ZAP handler, which
// libzmq asks whether a client's key may finish its handshake, and socket monitors, the only place where
// libzmq says why a handshake failed or that a connection came or went.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <zmq.hpp>

namespace ringmaster::net {

// ZAP (rfc.zeromq.org/spec/27), bound at inproc://zeromq.zap.01 in the context it is made in. Without a
// handler libzmq lets any key in, so make it before any CURVE server socket of that context binds.
class zap_handler {
 public:
  explicit zap_handler(zmq::context_t& ctx);  // throws zmq::error_t
  int fd() const { return fd_; }
  // The decision on one client: a ZAP status and its text. A CURVE client comes with its Z85 public key;
  // a NULL client (of a socket without keys, --insecure: counted, not authenticated) with nothing.
  // "200" lets it in (the key becomes the User-Id of its messages); "400" refuses its key; "500" refuses
  // it for another reason (libzmq's clients hang on "300").
  struct verdict {
    std::string status, text;
  };
  struct request {
    std::string key;    // CURVE
    bool null = false;  // NULL: no credentials
    std::string address;
  };
  using decide = std::function<verdict(const request&)>;
  // Answers every request waiting; a malformed one, or one neither CURVE nor NULL, is refused without
  // asking `d`.
  void serve(const decide& d);

 private:
  zmq::socket_t socket_;
  int fd_ = -1;
};

// zmq_socket_monitor on a socket, and the PAIR socket its events are read from.
class socket_monitor {
 public:
  // `name` must be unique in ctx. Null when libzmq refuses: the socket then goes unmonitored.
  static std::unique_ptr<socket_monitor> attach(zmq::context_t& ctx, zmq::socket_t& watched, const std::string& name,
                                                int events);
  int fd() const { return fd_; }
  // f(event, value) for each event waiting (ZMQ_EVENT_*, and its value: an fd, an errno, a status), at
  // most `max` of them.
  void drain(const std::function<void(uint16_t event, uint32_t value)>& f, int max = 4096);

 private:
  explicit socket_monitor(zmq::socket_t pair);
  zmq::socket_t pair_;
  int fd_ = -1;
};

}  // namespace ringmaster::net
