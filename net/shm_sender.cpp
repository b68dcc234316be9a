// The sending side of a shared-memory ring link (net/shm_link.hpp).
#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "net/shm_link.hpp"
#include "net/shm_segment.hpp"
#include "net/shm_window.hpp"

namespace ringmaster::net {
using namespace shm_segment;

namespace {

// A message on its way: its bytes, or (ref) where they lie in our lent window.
struct outgoing_record {
  wire::header h;
  payload p;
  bool ref = false;
  uint64_t at = 0;
};
using owners = std::vector<std::shared_ptr<const void>>;

}  // namespace

struct shm_sender::impl {
  mapping seg;
  mutable std::mutex mu;
  std::condition_variable wake;
  std::deque<outgoing_record> queue;  // waiting for room, in order
  // References written, whose owners we hold until the receiver's tail passes their end: (end, owner).
  std::deque<std::pair<uint64_t, std::shared_ptr<const void>>> held;
  std::shared_ptr<shm_window> window;  // offered to the receiver
  size_t queued_refs = 0;              // references in `queue`: held once written
  uint64_t refs_written = 0;
  bool wanted = false;                 // someone waits for the held owners (await_release)
  int reapers = 0;                     // reaper objects alive: they let the owners go, not the thread
  bool stop = false;
  uint64_t head = 0;  // ours alone; changed only under mu
  std::thread thread;
  // The sender was destroyed on this thread (an owner's last release, let go in loop(), took it with it):
  // the thread cannot join itself, so it ends on its own and frees this after loop() returns.
  bool self_owned = false;

  bool closed() const { return seg.ctl->closed.load(std::memory_order_acquire) != 0; }
  // Room for a record of `need` bytes (and the padding before it, if it must wrap)?
  bool fits(size_t need, uint64_t* pad) const {
    const uint64_t cap = kShmCapacity, off = head % cap;
    *pad = cap - off < need ? cap - off : 0;
    return head + *pad + need - seg.ctl->tail.load(std::memory_order_acquire) <= cap;
  }
  static size_t need(const outgoing_record& o) { return record_bytes(o.ref ? kRefPayload : o.p.size); }
  // Under mu, by whoever may write now (the queue is empty, or this is its front).
  bool try_write(outgoing_record& o) {
    const size_t need = impl::need(o);
    uint64_t pad = 0;
    if (!fits(need, &pad)) return false;
    if (pad) {
      std::memcpy(seg.data + head % kShmCapacity, &kPadRecord, sizeof kPadRecord);
      head += pad;
    }
    unsigned char* rec = seg.data + head % kShmCapacity;
    const uint64_t len = need | (o.ref ? kRefRecord : 0);
    const wire::header_bytes hb = wire::encode(o.h);
    std::memcpy(rec, &len, sizeof len);
    std::memcpy(rec + 8, hb.data(), hb.size());
    if (o.ref) std::memcpy(rec + kRecordHead, &o.at, sizeof o.at);
    else if (o.p.size) std::memcpy(rec + kRecordHead, o.p.data, o.p.size);
    head += need;
    if (o.ref) held.emplace_back(head, std::move(o.p.owner)), ++refs_written;
    control& c = *seg.ctl;
    c.head.store(head, std::memory_order_release);
    c.head_seq.fetch_add(1, std::memory_order_seq_cst);
    if (c.rx_waiting.load(std::memory_order_seq_cst)) futex_wake(&c.head_seq);
    return true;
  }
  // Under mu: moves the owners the receiver is done with (all, once it is gone) to *out, to be let go
  // without the lock (the last may wake a reducer).
  void collect(owners* out) {
    if (held.empty()) return;
    const bool gone = closed();
    const uint64_t tail = seg.ctl->tail.load(std::memory_order_acquire);
    while (!held.empty() && (gone || held.front().first <= tail)) {
      out->push_back(std::move(held.front().second));
      held.pop_front();
    }
    if (held.empty() && queued_refs == 0) wanted = false;
  }
  // Under mu: the thread must watch the receiver for the held owners.
  bool watch() const { return wanted && reapers == 0 && !held.empty(); }
  void loop();
};

shm_sender::shm_sender(std::unique_ptr<impl> d) : d_(std::move(d)) {}

std::unique_ptr<shm_sender> shm_sender::open(const shm_stamp& stamp, std::string* error, bool* missing) {
  *missing = false;
  const std::string name = shm_name(stamp);
  fd_guard f;
  // glibc adds O_NOFOLLOW and O_CLOEXEC; O_NONBLOCK: a FIFO someone put there does not hold us up.
  f.fd = shm_open(name.c_str(), O_RDWR | O_NONBLOCK, 0);
  if (f.fd < 0) {
    *missing = errno == ENOENT;
    return *error = sys_error("open /dev/shm" + name), nullptr;
  }
  struct stat st {};
  if (fstat(f.fd, &st) != 0) return *error = sys_error("stat /dev/shm" + name), nullptr;
  // Ours alone: another user could have made a file of this name, but not one owned by us.
  if (!S_ISREG(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 077) != 0) {
    *error = "/dev/shm" + name + " is not a segment of ours alone (owner or mode)";
    return nullptr;
  }
  if (st.st_size != off_t(kSegmentBytes)) {  // being made (or not one of ours): not ready, try the network
    *error = "/dev/shm" + name + " is not ready (" + std::to_string(st.st_size) + " bytes)";
    return nullptr;
  }
  auto d = std::make_unique<impl>();
  if (!d->seg.map(f.fd, error)) return nullptr;
  const control& c = *d->seg.ctl;
  if (c.magic.load(std::memory_order_acquire) != kShmMagic) {
    *error = "/dev/shm" + name + " is not ready (no stamp yet)";
    return nullptr;
  }
  if (c.version != kShmVersion || c.uid != geteuid() || c.job != stamp.job ||
      c.sender_rank != stamp.sender_rank || c.receiver_rank != stamp.receiver_rank || c.capacity != kShmCapacity) {
    *error = "/dev/shm" + name + " is not the segment for this ring (its stamp differs)";
    return nullptr;
  }
  if (c.head.load() != 0 || c.closed.load() != 0 || c.offer.load() != kNoOffer) {
    *error = "/dev/shm" + name + " is in use already";
    return nullptr;
  }
  auto s = std::unique_ptr<shm_sender>(new shm_sender(std::move(d)));
  try {
    s->d_->thread = std::thread([d = s->d_.get()] {
      d->loop();
      if (d->self_owned) delete d;  // set on this thread, by the destructor that ran here
    });
    pthread_setname_np(s->d_->thread.native_handle(), "rm-shm-send");
  } catch (const std::exception& x) {  // the name stays: the receiver removes it; we use the network
    *error = std::string("cannot start the sender's thread: ") + x.what();
    return nullptr;
  }
  shm_unlink(name.c_str());  // no one else may open it now
  return s;
}

void shm_sender::lend(std::shared_ptr<shm_window> w) {
  if (!w) return;
  std::lock_guard<std::mutex> lock(d_->mu);
  control& c = *d_->seg.ctl;
  if (d_->window || c.offer.load() != kNoOffer) return;  // offered once
  d_->window = std::move(w);
  const shm_window_id id = d_->window->id();
  c.offer_pid = id.pid;
  c.offer_fd = id.fd;
  c.offer_dev = id.dev;
  c.offer_ino = id.ino;
  c.offer_bytes = id.bytes;
  c.offer.store(kOffered, std::memory_order_release);
  // The receiver takes it up when it next looks for records: now, if it sleeps.
  c.head_seq.fetch_add(1, std::memory_order_seq_cst);
  if (c.rx_waiting.load(std::memory_order_seq_cst)) futex_wake(&c.head_seq);
}

shm_sender::window_state shm_sender::lending() const {
  switch (d_->seg.ctl->offer.load(std::memory_order_acquire)) {
    case kOffered: return window_state::offered;
    case kTaken: return window_state::taken;
    case kDeclined: return window_state::declined;
    default: return window_state::none;
  }
}

bool shm_sender::send(const wire::header& header, payload p, std::string* error, bool in_place) {
  wire::header h = header;
  h.payload_bytes = p.size;
  if (!wire::validate(h, error)) return false;
  if (p.size > kShmMaxPayload) {
    *error = "a payload of " + std::to_string(p.size) + " bytes is over the shared-memory link's limit of " +
             std::to_string(kShmMaxPayload);
    return false;
  }
  owners done;                         // let go of after the lock: the last may run the reducer's work,
  outgoing_record o{h, std::move(p)};  // which may send here again
  std::lock_guard<std::mutex> lock(d_->mu);
  d_->collect(&done);
  if (d_->closed()) return true;  // the receiver is gone: as a connection to a vanished peer drops
  // A reference only once the receiver has mapped the window (it checks every one against it).
  o.ref = in_place && o.p.size && d_->window && d_->seg.ctl->offer.load(std::memory_order_acquire) == kTaken &&
          d_->window->holds(o.p.data, o.p.size, &o.at);
  if (d_->queue.empty() && d_->try_write(o)) return true;
  // Copied: the caller may change its buffer once we return (a full buffer is rare: the ring waits for
  // its neighbours long before 16 MiB are on their way). A reference keeps its owner instead.
  if (!o.ref) {
    payload copy = o.p.size ? payload::copy_of(std::string_view(static_cast<const char*>(o.p.data), o.p.size)) : payload{};
    done.push_back(std::move(o.p.owner));
    o.p = std::move(copy);
  }
  d_->queued_refs += o.ref;
  d_->queue.push_back(std::move(o));
  d_->wake.notify_one();
  return true;
}

void shm_sender::reap() {
  owners done;
  std::unique_lock<std::mutex> lock(d_->mu, std::try_to_lock);  // busy: the next call, or the thread
  if (lock.owns_lock()) d_->collect(&done);
}

void shm_sender::await_release() {
  std::lock_guard<std::mutex> lock(d_->mu);
  if (d_->held.empty() && d_->queued_refs == 0) return;
  d_->wanted = true;  // for references still queued too: the thread watches once it has written them
  if (d_->watch()) d_->wake.notify_one();
}

uint64_t shm_sender::references() const {
  std::lock_guard<std::mutex> lock(d_->mu);
  return d_->refs_written;
}

size_t shm_sender::held() const {
  std::lock_guard<std::mutex> lock(d_->mu);
  return d_->held.size();
}

shm_sender::reaper::reaper(shm_sender& s) : s_(s) {
  std::lock_guard<std::mutex> lock(s_.d_->mu);
  ++s_.d_->reapers;
}

shm_sender::reaper::~reaper() {
  owners done;
  std::lock_guard<std::mutex> lock(s_.d_->mu);
  s_.d_->collect(&done);
  // Owners still held that someone waits for: the thread watches from now on.
  if (--s_.d_->reapers == 0 && s_.d_->watch()) s_.d_->wake.notify_one();
}

void shm_sender::impl::loop() {
  std::unique_lock<std::mutex> lock(mu);
  while (true) {
    wake.wait(lock, [&] { return stop || !queue.empty() || watch(); });
    if (stop) return;
    if (closed()) {  // what is queued or held goes, without the lock (an owner's last release may send)
      std::deque<outgoing_record> dropped;
      dropped.swap(queue);
      queued_refs = 0;
      owners done;
      collect(&done);
      lock.unlock();
      dropped.clear();
      done.clear();
      lock.lock();
      continue;
    }
    if (!queue.empty() && try_write(queue.front())) {
      queued_refs -= queue.front().ref;
      queue.pop_front();
      continue;
    }
    if (queue.empty() && held.empty()) continue;  // a reaper let them go meanwhile
    // Full, or owners held: wait for the receiver to consume, without the lock (send() only queues
    // meanwhile). The receiver wakes us when it gives space back, as we say we wait.
    const bool full = !queue.empty();
    const size_t need = full ? impl::need(queue.front()) : 0;
    const uint64_t until = full ? 0 : held.front().first;
    lock.unlock();
    control& c = *seg.ctl;
    c.tx_waiting.store(1, std::memory_order_seq_cst);
    const uint32_t seq = c.tail_seq.load(std::memory_order_seq_cst);
    uint64_t pad = 0;
    const bool wait = full ? !fits(need, &pad) : c.tail.load(std::memory_order_seq_cst) < until;
    if (wait && !closed()) futex_wait(&c.tail_seq, seq);
    c.tx_waiting.store(0, std::memory_order_relaxed);
    owners done;
    lock.lock();
    collect(&done);
    if (!done.empty()) {
      lock.unlock();
      done.clear();
      lock.lock();
    }
  }
}

shm_sender::~shm_sender() {
  {
    std::lock_guard<std::mutex> lock(d_->mu);
    d_->stop = true;
  }
  d_->wake.notify_one();
  d_->seg.ctl->tail_seq.fetch_add(1);  // not ours to bump, but harmless: the receiver only counts on it
  futex_wake(&d_->seg.ctl->tail_seq);
  if (detached_from_own_thread(d_->thread, &d_->self_owned)) {
    d_.release();  // the thread frees it
    return;
  }
  if (d_->thread.joinable()) d_->thread.join();
}

}  // namespace ringmaster::net
