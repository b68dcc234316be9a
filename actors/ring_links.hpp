// The links a reducer's ring driver (net/ring_driver.hpp) sends through: to a reducer in this process
// (its port, fed by the sending thread, reading the floats in place) or to one in another process (shared
// memory on one host; between hosts a TCP connection to the node's ring port, sealed or plain, or a
// ZeroMQ frame through the bridge, sent without a copy). The ring's code is the same for both.
#pragma once
#include <caf/all.hpp>
#include <memory>

#include "net/bridge.hpp"
#include "net/ring_driver.hpp"
#include "net/shm_link.hpp"
#include "net/tcp_link.hpp"

namespace ringmaster {

using link_ptr = std::shared_ptr<ring::link>;

class reducer_port;
// To a reducer in this process: the chunk goes straight into its port (actors/reducer.hpp), added and
// passed on by the sending thread.
link_ptr make_port_link(std::shared_ptr<reducer_port> port);
// Messages for the rank on the other end of a bridge connection (from bridge::connect). Host memory
// only: a reducer stages device memory before it gets here.
link_ptr make_bridge_link(net::bridge* br, int peer);
// To the rank on another process of this host through a shared-memory segment (net/shm_link.hpp). Host
// memory only, as through the bridge.
link_ptr make_shm_link(std::shared_ptr<net::shm_sender> out);
// To the rank on another node, over a TCP connection of our own to its ring port (net/tcp_link.hpp),
// sealed or plain (then written from the ring's buffer, which the driver lends it). Host memory only.
link_ptr make_tcp_link(std::shared_ptr<net::tcp_sender> out);
// Whether a link carries only host memory (it leaves the process).
bool host_only(const ring::link& l);

// The ring message in a received chunk frame (whose header the bridge has validated).
ring::message from_wire(const wire::header& h, net::payload p);

}  // namespace ringmaster
