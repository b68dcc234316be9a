// The sending side of a ring port's TCP link (net/tcp_link.hpp): tcp_sender.
#include "net/tcp_link.hpp"
#include "net/tcp_io.hpp"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

namespace ringmaster::net {
namespace {

using tcp_io::kHead;
using tcp_io::set_nodelay;
using tcp_io::signal_fd;
constexpr int kConnectTries = 20;  // a port that refuses: ~5 s of tries
constexpr auto kRetryPause = std::chrono::milliseconds(250);

// "HOST:PORT" or "[V6]:PORT" into its parts. False for anything else.
bool split_host_port(const std::string& text, std::string* host, std::string* port) {
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size() || text.size() - colon > 6) return false;
  *host = text.substr(0, colon);
  *port = text.substr(colon + 1);
  if (host->size() > 2 && host->front() == '[' && host->back() == ']') *host = host->substr(1, host->size() - 2);
  return std::all_of(port->begin(), port->end(), [](char c) { return c >= '0' && c <= '9'; });
}

}  // namespace

// ---- sender ----

struct tcp_sender::impl {
  std::string endpoint, host, port;
  uint64_t job = 0;
  uint32_t sender = 0;
  std::shared_ptr<sealer> seal;  // null: plain
  uint64_t plain_count = 0;      // plain: the trailers' count (what a sealer would number)
  std::function<void(const std::string&)> on_error;
  struct frame {
    std::unique_ptr<unsigned char[]> data;
    size_t cap = 0, size = 0, sent = 0;
    payload ext;  // plain: the payload, written from where it is (after data's size bytes), held till then
    size_t total() const { return size + ext.size; }
  };
  std::mutex mu;
  std::condition_variable cv;
  std::deque<frame> queue;     // waiting for the socket, in order (the login first)
  std::vector<frame> spares;  // written frames' buffers, for the next sends (a backed-up socket
                              // must not cost a fresh 1 MiB allocation, and its page faults, a chunk)
  // Plain payloads written or dropped, let go of only once mu is free: letting go may end an all-reduce
  // (net/ring_driver.hpp counts its buffer's readers), and whoever waits for that may send at once.
  std::vector<payload> written;
  int letting_go = 0;             // threads in let_go with mu unlocked: abort() waits for them, on let_go_done
  std::condition_variable let_go_done;  // (not cv: the sender's thread waits there, and need not wake each time)
  int fd = -1;
  bool connected = false, dead = false, stop = false;
  bool looking_up = false;  // the thread waits for getaddrinfo, which nothing can cut short
  std::thread thread;
  // Signalled when our owner goes: a connect still waiting (up to a second, for a host that does not
  // answer) ends at once, so dropping a sender never holds up its owner's thread (a node's bridge thread,
  // whose heartbeats must go on while a ring re-forms).
  int wake = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);

  ~impl() {
    if (fd >= 0) close(fd);
    if (wake >= 0) close(wake);
  }
  // Under mu: a frame of `bytes` bytes, a spare one if one is large enough.
  frame make_frame(size_t bytes) {
    frame f;
    for (size_t i = spares.size(); i-- > 0;)
      if (spares[i].cap >= bytes) {
        f = std::move(spares[i]);
        spares.erase(spares.begin() + long(i));
        break;
      }
    if (f.cap < bytes) f = {std::unique_ptr<unsigned char[]>(new unsigned char[bytes]), bytes, 0, 0, {}};
    f.size = bytes;
    f.sent = 0;
    return f;
  }
  // Under mu: writes queued frames until the socket takes no more. 1 all written, 0 the socket is full,
  // -1 the connection broke.
  int flush() {
    while (!queue.empty()) {
      frame& f = queue.front();
      while (f.sent < f.total()) {
        iovec io[2];
        int parts = 0;
        if (f.sent < f.size) io[parts++] = {f.data.get() + f.sent, f.size - f.sent};
        const size_t into_ext = f.sent > f.size ? f.sent - f.size : 0;
        if (f.ext.size > into_ext) io[parts++] = {const_cast<char*>(static_cast<const char*>(f.ext.data)) + into_ext, f.ext.size - into_ext};
        msghdr m{};
        m.msg_iov = io;
        m.msg_iovlen = size_t(parts);
        const ssize_t n = ::sendmsg(fd, &m, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n > 0) f.sent += size_t(n);
        else if (n < 0 && errno == EINTR) continue;
        else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
        else return -1;
      }
      if (f.ext.owner) written.push_back(std::move(f.ext));
      f.ext = {};
      if (spares.size() < 8) spares.push_back(std::move(f));
      queue.pop_front();
    }
    return 1;
  }
  // The trailer after the header at `frame`, and n payload bytes from `in` to `out`: sealed, or plain.
  bool wrap(unsigned char* frame, const void* in, void* out, size_t n) {
    if (seal) return seal->seal(frame, wire::kHeaderSize, in, out, n, frame + wire::kHeaderSize);
    write_trailer({job, sender, plain_count++}, frame + wire::kHeaderSize);
    if (n) std::memcpy(out, in, n);
    return true;
  }
  // The connection is gone (or never came): what waits is dropped, and so is what comes.
  void give_up() {
    dead = true;
    for (frame& f : queue)
      if (f.ext.owner) written.push_back(std::move(f.ext));
    queue.clear();
  }
  // Under lock: lets go of the written payloads with mu unlocked for the while.
  void let_go(std::unique_lock<std::mutex>& lock) {
    if (written.empty()) return;
    std::vector<payload> done;
    done.swap(written);
    ++letting_go;
    ++letting_go_here;
    lock.unlock();
    done.clear();
    lock.lock();
    --letting_go_here;
    if (--letting_go == 0) let_go_done.notify_all();
  }
  // This thread's let_go calls under way (of any sender): a release that calls abort() must not wait for itself.
  static thread_local int letting_go_here;
  int connect_once(std::string* why);
  void run();
};

thread_local int tcp_sender::impl::letting_go_here = 0;

int tcp_sender::impl::connect_once(std::string* why) {
  addrinfo hints{}, *found = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (stop || dead) return -1;
    looking_up = true;
  }
  const int e = getaddrinfo(host.c_str(), port.c_str(), &hints, &found);
  {
    std::lock_guard<std::mutex> lock(mu);
    looking_up = false;
    if (stop || dead) {  // our owner went (or aborted) while we looked: no connection to anyone now
      if (e == 0) freeaddrinfo(found);
      return -1;
    }
  }
  if (e != 0) return *why = gai_strerror(e), -1;
  int s = -1;
  for (addrinfo* a = found; a && s < 0; a = a->ai_next) {
    s = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (s < 0) {
      *why = std::strerror(errno);  // no file descriptor left, say
      continue;
    }
    int err = 0;
    if (::connect(s, a->ai_addr, a->ai_addrlen) != 0) {
      err = errno;
      if (err == EINPROGRESS) {  // wait up to a second for it, or until our owner goes
        pollfd p[2] = {{s, POLLOUT, 0}, {wake, POLLIN, 0}};
        socklen_t len = sizeof err;
        int n;
        do n = ::poll(p, 2, 1000);
        while (n < 0 && errno == EINTR);
        if (p[1].revents) err = ECANCELED;
        else err = n > 0 && getsockopt(s, SOL_SOCKET, SO_ERROR, &err, &len) == 0 ? err : ETIMEDOUT;
      }
    }
    if (err != 0) *why = std::strerror(err), close(s), s = -1;
  }
  freeaddrinfo(found);
  if (s >= 0) set_nodelay(s);
  return s;
}

void tcp_sender::impl::run() {
  std::string why;
  int s = -1;
  std::unique_lock<std::mutex> lock(mu);
  for (int attempt = 0; attempt < kConnectTries && s < 0; ++attempt) {
    if (attempt > 0 ? cv.wait_for(lock, kRetryPause, [this] { return stop || dead; }) : stop || dead) return;
    lock.unlock();
    s = connect_once(&why);
    lock.lock();
    if (stop || dead) {  // our owner went, or aborted: nobody to tell, nothing to send (checked under the
      if (s >= 0) close(s);  // same lock that then takes the connection, so an abort never misses one)
      return;
    }
  }
  if (s < 0) {
    give_up();
    let_go(lock);
    if (stop) return;  // our owner is going: nobody to tell
    lock.unlock();
    if (on_error)
      on_error("cannot reach " + endpoint + " (a ring port) after " + std::to_string(kConnectTries) + " tries (" + why +
               "): is it open (ringmaster-node --ring-port) in the firewall?");
    return;
  }
  fd = s;
  connected = true;
  for (;;) {
    cv.wait(lock, [this] { return stop || !queue.empty(); });
    if (stop) return;
    const int r = flush();
    if (r < 0) give_up();  // the other side went: the job's heartbeats and watchdog say who
    let_go(lock);
    if (r < 0) return;
    if (r == 0) {
      lock.unlock();
      pollfd p{s, POLLOUT, 0};
      ::poll(&p, 1, 100);
      lock.lock();
    }
  }
}

tcp_sender::tcp_sender(std::shared_ptr<impl> d) : d_(std::move(d)) {}

std::shared_ptr<tcp_sender> tcp_sender::connect(const std::string& endpoint, uint64_t job, uint32_t sender,
                                                std::shared_ptr<sealer> seal, std::function<void(const std::string&)> on_error,
                                                std::string* error) {
  auto d = std::make_shared<impl>();
  d->endpoint = endpoint;
  if (endpoint.rfind("tcp://", 0) != 0 || !split_host_port(endpoint.substr(6), &d->host, &d->port))
    return *error = "not a tcp://HOST:PORT endpoint: " + endpoint, nullptr;
  d->job = job;
  d->sender = sender;
  d->seal = std::move(seal);
  d->on_error = std::move(on_error);
  // The login, made (sealed) here so that it takes the counter before any message does.
  wire::header h;
  h.type = wire::msg_type::hello;
  h.job_id = job;
  h.sender_rank = int32_t(sender);
  const auto hb = wire::encode(h);
  impl::frame f = d->make_frame(kHead);
  std::memcpy(f.data.get(), hb.data(), hb.size());
  unsigned char* none = f.data.get() + kHead;  // no payload
  if (sender > uint32_t(INT32_MAX) || !d->wrap(f.data.get(), none, none, 0))
    return *error = "cannot make the login", nullptr;
  d->queue.push_back(std::move(f));
  auto s = std::shared_ptr<tcp_sender>(new tcp_sender(std::move(d)));
  try {
    s->d_->thread = std::thread([p = s->d_] { p->run(); });
    pthread_setname_np(s->d_->thread.native_handle(), "rm-tcp-send");
  } catch (const std::exception& e) {
    return *error = std::string("cannot start the sending thread: ") + e.what(), nullptr;
  }
  return s;
}

tcp_sender::~tcp_sender() {
  bool detach = d_->thread.get_id() == std::this_thread::get_id();
  std::vector<payload> held;
  std::function<void(const std::string&)> on_error;
  std::shared_ptr<sealer> seal;
  {
    std::lock_guard<std::mutex> lock(d_->mu);
    d_->stop = true;
    if (d_->fd >= 0) shutdown(d_->fd, SHUT_RDWR);  // a poll for room returns at once
    // A host name's lookup may take as long as a dead DNS server makes it: the thread is left to end
    // on its own (it holds d_, sees `stop` and sends nothing), and what it held is let go of here.
    if (d_->looking_up) {
      detach = true;
      d_->give_up();
      held.swap(d_->written);
      on_error.swap(d_->on_error);  // and whatever it holds
      seal.swap(d_->seal);          // and the pair's keys (after `stop` the thread seals nothing)
    }
  }
  held.clear();
  on_error = nullptr;
  seal = nullptr;
  d_->cv.notify_all();
  signal_fd(d_->wake);  // and so does a connect under way
  // From its own thread (on_error dropped the last of us): it ends once on_error returns, holding d_.
  if (detach) d_->thread.detach();
  else if (d_->thread.joinable()) d_->thread.join();
}

bool tcp_sender::sealed() const { return d_->seal != nullptr; }

void tcp_sender::abort() {
  impl& d = *d_;
  std::unique_lock<std::mutex> lock(d.mu);  // a write under way (flush holds mu) ends first
  d.give_up();
  if (d.fd >= 0) shutdown(d.fd, SHUT_RDWR);
  d.let_go(lock);
  // Payloads another thread took out of `written` are let go of before we return (unless it is this
  // thread, releasing one that led here).
  if (impl::letting_go_here == 0) d.let_go_done.wait(lock, [&d] { return d.letting_go == 0; });
  lock.unlock();
  d.cv.notify_all();    // a connect's retry pause ends
  signal_fd(d.wake);    // and so does a connect under way
}

bool tcp_sender::send(const wire::header& h, const payload& p, std::string* error) {
  if (p.size > kMaxRingPayload)
    return *error = "a message of " + std::to_string(p.size) + " bytes, over the limit of " +
                    std::to_string(kMaxRingPayload), false;
  wire::header w = h;
  w.payload_bytes = p.size;
  if (!wire::validate(w, error)) return false;
  const auto hb = wire::encode(w);
  impl& d = *d_;
  std::unique_lock<std::mutex> lock(d.mu);
  if (d.dead || d.stop) return true;  // dropped, as a connection to a vanished peer drops it
  // Plain, a payload with an owner is written from where it is (zero-copy, as through the bridge).
  const bool in_place = !d.seal && p.owner && p.size > 0;
  impl::frame f = d.make_frame(in_place ? kHead : kHead + p.size);
  std::memcpy(f.data.get(), hb.data(), hb.size());
  if (in_place) {
    write_trailer({d.job, d.sender, d.plain_count++}, f.data.get() + wire::kHeaderSize);
    f.ext = p;
  } else if (!d.wrap(f.data.get(), p.data, f.data.get() + kHead, p.size)) {
    return *error = "sealing failed", false;
  }
  const bool idle = d.queue.empty();
  d.queue.push_back(std::move(f));
  if (idle && d.connected) {  // written here, on the caller's thread: no wake-up of ours
    if (const int r = d.flush(); r != 0) {
      if (r < 0) d.give_up();
      d.let_go(lock);
      return true;
    }
    d.let_go(lock);
  }
  d.cv.notify_one();
  return true;
}

}  // namespace ringmaster::net
