#include "net/shm_link.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <dirent.h>
#include <fstream>
#include <signal.h>
#include <deque>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#include <openssl/evp.h>

#include "net/ring_driver.hpp"
#include "net/shm_window.hpp"

namespace ringmaster::net {
namespace {

constexpr uint64_t kShmMagic = 0x4d48535f474e4952ull;  // "RING_SHM"
constexpr uint32_t kShmVersion = 2;
constexpr size_t kControlBytes = 4096;
constexpr size_t kRecordAlign = 64;
constexpr size_t kRecordHead = 8 + wire::kHeaderSize;  // length and header: payloads start 64-aligned
constexpr uint64_t kPadRecord = ~uint64_t(0);
// Set in a record's length: its payload is the offset of the bytes in the sender's lent window.
constexpr uint64_t kRefRecord = uint64_t(1) << 62;
constexpr size_t kRefPayload = sizeof(uint64_t);
// control::offer: the sender's window (shm_sender::lend), and what the receiver made of it.
enum : uint32_t { kNoOffer = 0, kOffered = 1, kTaken = 2, kDeclined = 3 };
constexpr int kWaitMs = 100;  // futex waits wake this often to see a stop
static_assert(kRecordHead == kRecordAlign);
static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free);

// The segment's first page. The receiver writes the stamp, then publishes it with magic (release); a
// sender that sees no magic yet (acquire) found a segment still being made.
struct control {
  std::atomic<uint64_t> magic;
  uint32_t version;
  uint32_t uid;
  uint64_t job;
  int32_t sender_rank;
  int32_t receiver_rank;
  uint64_t capacity;
  int32_t pid;  // the receiver's process, for whoever looks
  alignas(64) std::atomic<uint64_t> head;   // bytes written: the sender's
  std::atomic<uint32_t> head_seq;           // one more per record: the receiver's futex
  std::atomic<uint32_t> rx_waiting;         // the receiver sleeps (or is about to) on head_seq
  alignas(64) std::atomic<uint64_t> tail;   // bytes consumed: the receiver's
  std::atomic<uint32_t> tail_seq;           // one more per record consumed: the sender's futex
  std::atomic<uint32_t> tx_waiting;
  alignas(64) std::atomic<uint32_t> closed;  // the receiver is gone or gave up: senders drop messages
  // The sender writes the window's id, then offer = kOffered (release); the receiver answers kTaken or
  // kDeclined.
  alignas(64) std::atomic<uint32_t> offer;
  int32_t offer_pid, offer_fd;
  uint64_t offer_dev, offer_ino, offer_bytes;
};
static_assert(sizeof(control) <= kControlBytes);
// tests/test_shm_link.cpp writes a broken sender's records at these offsets.
static_assert(offsetof(control, head) == 64 && offsetof(control, head_seq) == 72 && offsetof(control, pid) == 40);
static_assert(offsetof(control, offer) == 256 && offsetof(control, offer_pid) == 260 && offsetof(control, offer_fd) == 264 &&
              offsetof(control, offer_dev) == 272 && offsetof(control, offer_ino) == 280 && offsetof(control, offer_bytes) == 288);

constexpr size_t kSegmentBytes = kControlBytes + kShmCapacity;
// The ring's messages must fit, or a job would fail where the network would carry it.
static_assert(ring::driver_options{}.segment_elems * sizeof(float) <= kShmMaxPayload &&
              ring::driver_options{}.pair_small_bytes <= kShmMaxPayload);

// A spinning thread's hint to the core (and to its hyperthread twin).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Shared (not FUTEX_PRIVATE): the word lives in memory two processes map. True when it waited the whole
// kWaitMs (nobody woke it).
bool futex_wait(std::atomic<uint32_t>* word, uint32_t seen) {
  timespec ts{kWaitMs / 1000, (kWaitMs % 1000) * 1000000L};
  const long r = syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, seen, &ts, nullptr, 0);
  return r != 0 && errno == ETIMEDOUT;
}
void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

std::string sys_error(const std::string& what) { return what + ": " + std::strerror(errno); }

size_t record_bytes(size_t payload) { return (kRecordHead + payload + kRecordAlign - 1) / kRecordAlign * kRecordAlign; }

// A mapping of a whole segment.
struct mapping {
  void* base = MAP_FAILED;
  control* ctl = nullptr;
  unsigned char* data = nullptr;

  bool map(int fd, std::string* error) {
    // Populated at once: otherwise every page faults the first time each side touches it, and until
    // the buffer has wrapped once, a 200 KB message cost ~100 faults and took 0.2 ms instead of 0.05.
    base = mmap(nullptr, kSegmentBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (base == MAP_FAILED) return *error = sys_error("mmap"), false;
    ctl = static_cast<control*>(base);
    data = static_cast<unsigned char*>(base) + kControlBytes;
    return true;
  }
  ~mapping() {
    if (base != MAP_FAILED) munmap(base, kSegmentBytes);
  }
};

struct fd_guard {
  int fd = -1;
  ~fd_guard() {
    if (fd >= 0) close(fd);
  }
};

}  // namespace

std::string shm_name(const shm_stamp& s) {
  // Anyone may list /dev/shm: the name holds a hash of the ring and the rank, not the job's id.
  static const char kDomain[] = "ringmaster shm segment";
  unsigned char msg[sizeof kDomain - 1 + 12];
  std::memcpy(msg, kDomain, sizeof kDomain - 1);
  unsigned char* p = msg + sizeof kDomain - 1;
  for (int i = 0; i < 8; ++i) *p++ = static_cast<unsigned char>(s.job >> (8 * i));
  for (int i = 0; i < 4; ++i) *p++ = static_cast<unsigned char>(uint32_t(s.receiver_rank) >> (8 * i));
  unsigned char md[EVP_MAX_MD_SIZE] = {};
  unsigned int md_len = 0;
  EVP_Digest(msg, sizeof msg, md, &md_len, EVP_sha256(), nullptr);  // cannot fail short of no memory
  char name[96];
  int n = std::snprintf(name, sizeof name, "/ringmaster.%u.", unsigned(geteuid()));
  for (int i = 0; i < 12; ++i) n += std::snprintf(name + n, sizeof name - size_t(n), "%02x", md[i]);
  return name;
}

// ---- receiver ----

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
    d_->thread = std::thread([d = d_.get()] { d->loop(); });
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
  if (d_->thread.joinable()) d_->thread.join();
  if (d_->seg.ctl) {
    d_->seg.ctl->closed.store(1);
    d_->seg.ctl->tail_seq.fetch_add(1);
    futex_wake(&d_->seg.ctl->tail_seq);  // a sender waiting for room sees it and drops its queue
  }
  shm_unlink(d_->name.c_str());  // ENOENT when the sender has removed it
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
  bool finished = done();
  for (uint32_t idle = 0; !finished && !d.stop.load(std::memory_order_relaxed);) {
    const int n = d.take();
    if (n < 0) break;
    if (n > 0) {
      finished = done();
      continue;
    }
    // Nothing to take: the end may still come from another thread (sends let go, a strand that ran the
    // last job elsewhere), so ask done() now and then, not only after a record.
    if ((++idle & 63) == 0 && ((finished = done()) || std::chrono::steady_clock::now() >= until)) break;
    cpu_relax();
  }
  return finished;
}

// ---- sender ----

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
    s->d_->thread = std::thread([d = s->d_.get()] { d->loop(); });
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
  if (d_->thread.joinable()) d_->thread.join();
}

bool poll_reaping(shm_receiver* in, shm_sender& out, std::chrono::steady_clock::time_point until,
                  const std::function<bool()>& done) {
  shm_sender::reaper r(out);
  const auto reaped = [&] {
    out.reap();
    return done();
  };
  return in ? in->poll(until, reaped) : reaped();
}

// ---- hosts and leftovers ----

std::string host_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string boot;
  struct stat shm {};
  if (!std::getline(in, boot) || boot.size() < 32 || boot.size() > 40 || stat("/dev/shm", &shm) != 0) return "";
  // Containers share the boot id; their /dev/shm mounts tell them apart.
  char dev[48];
  std::snprintf(dev, sizeof dev, "%llx.%llx", (unsigned long long)shm.st_dev, (unsigned long long)shm.st_ino);
  return boot + "/" + dev + "/" + std::to_string(geteuid());
}

int sweep_segments() {
  const std::string prefix = "ringmaster." + std::to_string(geteuid()) + ".";
  DIR* dir = opendir("/dev/shm");
  if (!dir) return 0;
  int removed = 0;
  while (dirent* e = readdir(dir)) {
    const std::string name = e->d_name;
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    // Non-blocking (a FIFO of this name must not hang us), ours and a plain file, before anything is read.
    fd_guard f;
    f.fd = shm_open(("/" + name).c_str(), O_RDONLY | O_NONBLOCK, 0);
    struct stat st {};
    if (f.fd < 0 || fstat(f.fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() ||
        st.st_size < off_t(sizeof(control)))
      continue;
    unsigned char raw[sizeof(control)];  // only the stamp: read, not mapped
    uint64_t magic = 0;
    if (pread(f.fd, raw, sizeof raw, 0) != ssize_t(sizeof raw)) continue;
    std::memcpy(&magic, raw + offsetof(control, magic), sizeof magic);
    // Its receiver holds a lock on it while it lives (whatever pid namespace it is in): none, it is gone.
    if (magic == kShmMagic && flock(f.fd, LOCK_EX | LOCK_NB) == 0) removed += shm_unlink(("/" + name).c_str()) == 0;
  }
  closedir(dir);
  return removed;
}

}  // namespace ringmaster::net
