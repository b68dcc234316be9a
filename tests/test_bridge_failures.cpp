// The bridge's failed sends: said in order with what their peer sent before it went. Real sockets on
// 127.0.0.1 (ports chosen at run time); every wait has a deadline.
#include <catch2/catch.hpp>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "net/bridge.hpp"

using namespace ringmaster;
using namespace std::chrono_literals;

TEST_CASE("bridge: what a client sent before it went is handled before a reply to it is said to have failed", "[bridge]") {
  // A launcher says "finished" and closes at once. A node that sent it a heartbeat before reading that
  // was told its send failed first, and ended the job as though its launcher had broken off.
  net::bridge server, client;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> events;
  bool client_gone = false;
  auto note = [&](std::string what) {
    std::lock_guard<std::mutex> lock(mu);
    events.push_back(std::move(what));
    cv.notify_all();
  };
  server.set_handler([&](const net::peer_info& from, const wire::header& h, net::payload) {
    note("message " + std::to_string(h.step));
    if (h.step != 1) return;
    {  // the bridge thread busy here while the client sends its last word and closes
      std::unique_lock<std::mutex> lock(mu);
      cv.wait_for(lock, 5s, [&] { return client_gone; });
    }
    std::this_thread::sleep_for(1s);  // ZeroMQ's I/O thread sees the connection close (a loaded machine: slowly)
    wire::header hb;
    hb.type = wire::msg_type::heartbeat;
    server.reply(from, hb);
  });
  server.set_error_handler([&](const net::bridge_error& e) {
    if (e.kind == net::fault::send_failed) note("send failed");
  });
  std::string err;
  REQUIRE(server.start("tcp://127.0.0.1:0", &err));
  REQUIRE(client.start("", &err));
  const int to = client.connect(server.endpoint(), &err);
  REQUIRE(to >= 0);
  wire::header h;
  h.type = wire::msg_type::heartbeat;
  h.step = 1;
  REQUIRE(client.send(to, h));
  {
    std::unique_lock<std::mutex> lock(mu);
    REQUIRE(cv.wait_for(lock, 5s, [&] { return !events.empty(); }));
  }
  h.step = 2;  // its last word, then it goes
  REQUIRE(client.send(to, h));
  client.stop(500ms);
  {
    std::lock_guard<std::mutex> lock(mu);
    client_gone = true;
    cv.notify_all();
  }
  std::unique_lock<std::mutex> lock(mu);
  REQUIRE(cv.wait_for(lock, 5s, [&] { return events.size() >= 3; }));
  CHECK(events == std::vector<std::string>{"message 1", "message 2", "send failed"});
}
