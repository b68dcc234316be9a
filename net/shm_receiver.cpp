// The receiving side of a shared-memory ring link (net/shm_link.hpp).
#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <mutex>
#include <thread>

#include "net/shm_link.hpp"
#include "net/shm_segment.hpp"
#include "net/shm_window.hpp"
#include "net/spin.hpp"

namespace ringmaster::net {
using namespace shm_segment;

namespace {

// The segment as the receiver and the payloads it lends share it. Payloads are handed on in place, not
// copied out: a record's space goes back to the sender (tail) once its reader and the readers of every
// record before it have let go. The payloads hold this, so the mapping outlives a receiver that is gone
// before its readers are done.
struct lent_segment {
  mapping seg;
  std::mutex mu;
  std::deque<std::pair<uint64_t, bool>> records;  // read, not given back: (where it ends, let go), in order

  // The receiving thread read a record ending at `end`; `free`: it lends nothing (a header alone, padding).
  void read(uint64_t end, bool free) {
    std::lock_guard<std::mutex> lock(mu);
    records.emplace_back(end, free);
    give_back();
  }
  // A reader let go of the payload of the record ending at `end`. Any thread; from a deleter, so no throw.
  void let_go(uint64_t end) noexcept {
    try {
      std::lock_guard<std::mutex> lock(mu);
      // Ends grow record by record: a binary search finds it.
      auto it = std::lower_bound(records.begin(), records.end(), end,
                                 [](const std::pair<uint64_t, bool>& r, uint64_t e) { return r.first < e; });
      if (it != records.end() && it->first == end) it->second = true;
      give_back();
    } catch (...) {  // a mutex that cannot lock: the space stays taken, the sender waits, the watchdog names it
    }
  }
  // Under mu: the space of the records let go, up to the first one still lent.
  void give_back() {
    bool moved = false;
    uint64_t tail = 0;
    while (!records.empty() && records.front().second) {
      tail = records.front().first;
      records.pop_front();
      moved = true;
    }
    if (!moved) return;
    seg.ctl->tail.store(tail, std::memory_order_release);
    seg.ctl->tail_seq.fetch_add(1, std::memory_order_seq_cst);
    if (seg.ctl->tx_waiting.load(std::memory_order_seq_cst)) futex_wake(&seg.ctl->tail_seq);
  }
};

}  // namespace

struct shm_receiver::impl {
  std::shared_ptr<lent_segment> lent = std::make_shared<lent_segment>();
  mapping& seg = lent->seg;
  fd_guard lock;  // the segment's fd, flock()ed while we live: sweep_segments leaves it alone
  std::string name;
  std::thread thread;
  std::atomic<bool> stop{false};
  // The receiver was destroyed on this thread (from a handler): it cannot join itself, so it closes the
  // segment and frees this after loop() returns.
  bool self_owned = false;
  void close_segment() {
    if (seg.ctl) {
      seg.ctl->closed.store(1);
      seg.ctl->tail_seq.fetch_add(1);
      futex_wake(&seg.ctl->tail_seq);  // a sender waiting for room sees it and drops its queue
    }
    shm_unlink(name.c_str());  // ENOENT when the sender has removed it
  }
  handler on_message;
  error_handler on_error;
  // Records are taken by the thread or, while it waits for them, by a poller (poll()): whoever holds
  // `consume`. While a poller polls, the sender is told nobody sleeps (rx_waiting 0), so it wakes no one.
  std::mutex consume;
  std::atomic<uint64_t> taken{0};     // where the next record starts: written under consume, read by anyone
  std::atomic<bool> polling{false};
  std::atomic<uint64_t> missed{0};    // see missed_wakeups()
  bool dead = false;                  // under consume: broken() was said
  bool offer_seen = false;            // under consume
  std::shared_ptr<const shm_window_view> view;  // under consume: the sender's window, once taken

  // Under consume: maps the window the sender offers, or declines it (it then copies as before).
  void take_offer();

  void loop();
  // Under consume: hands on the next record if one is there. 1: one was, 0: none, -1: the link is dead.
  int take();
  // The other side broke the segment's rules: close it (a waiting sender wakes and drops its queue) and
  // say so, once. Nothing thrown here may leave the thread.
  void broken(const std::string& why) noexcept {
    seg.ctl->closed.store(1);
    seg.ctl->tail_seq.fetch_add(1);
    futex_wake(&seg.ctl->tail_seq);
    try {
      if (on_error) on_error("shared-memory link " + name + ": " + why);
    } catch (...) {
    }
  }
};

shm_receiver::shm_receiver(std::unique_ptr<impl> d) : d_(std::move(d)) {}

std::unique_ptr<shm_receiver> shm_receiver::create(const shm_stamp& stamp, std::string* error) {
  auto d = std::make_unique<impl>();
  d->name = shm_name(stamp);
  fd_guard f;
  f.fd = shm_open(d->name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (f.fd < 0) return *error = sys_error("create /dev/shm" + d->name), nullptr;
  // From here on the name is ours: the destructor removes it whatever fails next.
  auto r = std::unique_ptr<shm_receiver>(new shm_receiver(std::move(d)));
  impl& s = *r->d_;
  // posix_fallocate, not ftruncate alone: a full /dev/shm must fail here, not as SIGBUS on a later write.
  if (fchmod(f.fd, 0600) != 0) return *error = sys_error("chmod " + s.name), nullptr;
  if (int e = posix_fallocate(f.fd, 0, off_t(kSegmentBytes)); e != 0) {
    errno = e;
    return *error = sys_error("reserve " + std::to_string(kSegmentBytes >> 20) + " MiB in /dev/shm"), nullptr;
  }
  if (!s.seg.map(f.fd, error)) return nullptr;
  if (flock(f.fd, LOCK_EX | LOCK_NB) != 0) return *error = sys_error("lock " + s.name), nullptr;
  std::swap(s.lock.fd, f.fd);
  control* c = new (s.seg.base) control{};
  c->version = kShmVersion;
  c->uid = uint32_t(geteuid());
  c->job = stamp.job;
  c->sender_rank = stamp.sender_rank;
  c->receiver_rank = stamp.receiver_rank;
  c->capacity = kShmCapacity;
  c->pid = int32_t(getpid());
  c->magic.store(kShmMagic, std::memory_order_release);
  return r;
}

void shm_receiver::start(handler h, error_handler e) {
  d_->on_message = std::move(h);
  d_->on_error = std::move(e);
  try {
    d_->thread = std::thread([d = d_.get()] {
      d->loop();
      if (d->self_owned) d->close_segment(), delete d;  // set on this thread, by the destructor that ran here
    });
    pthread_setname_np(d_->thread.native_handle(), "rm-shm-recv");
  } catch (const std::exception& x) {  // no thread to be had: the link is dead, the ring's watchdog names it
    std::lock_guard<std::mutex> lock(d_->consume);
    d_->dead = true;
    d_->broken(std::string("cannot start its thread: ") + x.what());
  }
}

shm_receiver::~shm_receiver() {
  d_->stop.store(true);
  // The words change before the wake, so a thread about to sleep on the old value does not.
  if (d_->seg.ctl) d_->seg.ctl->head_seq.fetch_add(1), futex_wake(&d_->seg.ctl->head_seq);
  if (detached_from_own_thread(d_->thread, &d_->self_owned)) {
    d_.release();  // the thread closes the segment and frees it
    return;
  }
  if (d_->thread.joinable()) d_->thread.join();
  d_->close_segment();
}

void shm_receiver::impl::loop() {
  control& c = *seg.ctl;
  while (!stop.load(std::memory_order_relaxed)) {
    if (!polling.load(std::memory_order_acquire)) {
      std::unique_lock<std::mutex> lock(consume, std::try_to_lock);
      if (lock.owns_lock()) {
        const int n = take();
        if (n < 0) return;
        if (n > 0) continue;
      }
    }
    // The futex word first, then what it guards: whoever changes any of that after this read (a sender's
    // record, a poller that stops) bumps the word, and the wait returns at once. Then say we sleep and look
    // again: a sender that wrote before seeing rx_waiting is seen here. While a poller polls we sleep
    // unannounced: it takes the records, and announces us and wakes us when it stops.
    const uint32_t seq = c.head_seq.load(std::memory_order_seq_cst);
    const bool poller = polling.load(std::memory_order_seq_cst);
    if (!poller) c.rx_waiting.store(1, std::memory_order_seq_cst);
    bool slept_through = false;
    if ((poller || c.head.load(std::memory_order_seq_cst) == taken.load(std::memory_order_seq_cst)) && !stop.load())
      slept_through = futex_wait(&c.head_seq, seq);
    // We slept the whole wait, no poll runs now (while one does, a waiting record is the poller's), and a
    // record is there: its sender (we had announced ourselves) or the poll that ended (it announces us and
    // wakes us for what is left) owed us a wake-up.
    if (slept_through && !polling.load(std::memory_order_seq_cst) &&
        c.head.load(std::memory_order_seq_cst) != taken.load(std::memory_order_seq_cst))
      missed.fetch_add(1, std::memory_order_relaxed);
    // Awake: senders need not wake us (only if we announced ourselves: a poller may have since).
    if (!poller) c.rx_waiting.store(0, std::memory_order_seq_cst);
  }
}

void shm_receiver::impl::take_offer() {
  offer_seen = true;
  control& c = *seg.ctl;
  const shm_window_id id{c.offer_pid, c.offer_fd, c.offer_dev, c.offer_ino, c.offer_bytes};
  std::string error;
  view = shm_window_view::open(id, &error);
  c.offer.store(view ? kTaken : kDeclined, std::memory_order_release);
}

int shm_receiver::impl::take() {
  if (dead) return -1;
  control& c = *seg.ctl;
  if (!offer_seen && c.offer.load(std::memory_order_acquire) == kOffered) take_offer();
  const uint64_t cap = kShmCapacity;
  const auto fail = [this](const std::string& why) {
    dead = true;
    broken(why);
    return -1;
  };
  try {
    uint64_t tail = taken.load(std::memory_order_relaxed);  // ours alone while we hold consume
    const uint64_t head = c.head.load(std::memory_order_acquire);
    if (head == tail) return 0;
    if (head < tail || head - tail > cap) return fail("its write position is outside the buffer");
    if (head - c.tail.load(std::memory_order_acquire) > cap) return fail("it wrote over space still lent out");
    const uint64_t off = tail % cap;
    uint64_t len = 0;
    std::memcpy(&len, seg.data + off, sizeof len);
    if (len == kPadRecord) {
      if (off == 0) return fail("a padding record at the start of the buffer");
      if (tail + (cap - off) > head) return fail("padding past what was written");
      tail += cap - off;
      taken.store(tail, std::memory_order_release);
      lent->read(tail, true);
      return 1;
    }
    const bool ref = (len & kRefRecord) != 0;
    len &= ~kRefRecord;
    if (len < kRecordHead || len % kRecordAlign || len > cap - off || len > head - tail)
      return fail("a record of " + std::to_string(len) + " bytes does not fit where it is");
    unsigned char hb[wire::kHeaderSize];
    std::memcpy(hb, seg.data + off + 8, sizeof hb);
    wire::header h;
    std::string error;
    if (!wire::decode(hb, sizeof hb, &h, &error)) return fail("bad header: " + error);
    const void* data = seg.data + off + kRecordHead;
    if (ref) {  // the bytes are in the sender's window: the offset must keep them inside it
      if (!view) return fail("a reference to memory it did not lend");
      if (len < kRecordHead + kRefPayload) return fail("a reference record of " + std::to_string(len) + " bytes");
      uint64_t at = 0;
      std::memcpy(&at, data, sizeof at);
      if (h.payload_bytes == 0 || at % alignof(float) || at > view->bytes() || h.payload_bytes > view->bytes() - at)
        return fail("a reference to " + std::to_string(h.payload_bytes) + " bytes at " + std::to_string(at) +
                    " of a window of " + std::to_string(view->bytes()));
      data = view->data() + at;
    } else if (h.payload_bytes > len - kRecordHead || h.payload_bytes > kShmMaxPayload) {
      return fail("a payload of " + std::to_string(h.payload_bytes) + " bytes in a record of " + std::to_string(len));
    }
    tail += len;
    taken.store(tail, std::memory_order_release);
    lent->read(tail, h.payload_bytes == 0);
    payload p;
    if (h.payload_bytes > 0) {
      // Lent in place: the sender can only change floats it sent (it is our user, see the header). The
      // space of a reference's record comes back, as any other's, once its reader let go: that is how
      // the sender knows its window's bytes are read.
      p = payload{data, size_t(h.payload_bytes),
                  std::shared_ptr<const void>(data, [l = lent, end = tail, v = ref ? view : nullptr](const void*) { l->let_go(end); }),
                  true};
    }
    on_message(h, std::move(p));
    return 1;
  } catch (const std::exception& e) {
    return fail(std::string("handing on a message failed: ") + e.what());
  } catch (...) {
    return fail("handing on a message failed");
  }
}

uint64_t shm_receiver::missed_wakeups() const { return d_->missed.load(std::memory_order_relaxed); }

bool shm_receiver::poll(std::chrono::steady_clock::time_point until, const std::function<bool()>& done) {
  impl& d = *d_;
  std::unique_lock<std::mutex> lock(d.consume, std::try_to_lock);
  if (!lock.owns_lock() || d.dead) return done();  // the thread holds the link: it goes on taking records
  control& c = *d.seg.ctl;
  d.polling.store(true, std::memory_order_seq_cst);
  c.rx_waiting.store(0, std::memory_order_seq_cst);
  // However this ends (done() may throw): the thread may sleep unannounced, so announce it, bump the
  // word it sleeps on (a thread about to sleep then does not), and wake it if a record came meanwhile.
  struct hand_back {
    impl& d;
    control& c;
    std::unique_lock<std::mutex>& lock;
    ~hand_back() {
      d.polling.store(false, std::memory_order_seq_cst);
      c.rx_waiting.store(1, std::memory_order_seq_cst);
      lock.unlock();
      c.head_seq.fetch_add(1, std::memory_order_seq_cst);
      if (c.head.load(std::memory_order_seq_cst) != d.taken.load(std::memory_order_seq_cst)) futex_wake(&c.head_seq);
    }
  } give_back{d, c, lock};
  // With nothing to take, the end may still come from another thread (sends let go, a strand that ran
  // the last job elsewhere): done() is asked now and then, not only after a record.
  return spin_taking([&d] { return d.take(); }, done, until, d.stop, 64);
}

}  // namespace ringmaster::net
