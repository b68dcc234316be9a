// A one-way message link in shared memory, for two processes of one user on one host (two node daemons
// on one machine, say): what the ring sends its right neighbour goes through a ring buffer in a file under
// /dev/shm instead of through ZeroMQ, TCP and the kernel.
//
// Why: across processes on one host a ring message over TCP costs about four thread wake-ups (caller to
// bridge, bridge to ZeroMQ's I/O thread, the kernel, the peer's I/O thread to its bridge) and three copies;
// here the sender copies the message into the segment (or, from a window it lends, only says where it
// is) and the receiving thread, woken once (a futex in the segment), hands it on in place: the reducer
// adds it straight from the segment (or the sender's window) into its gradients.
// NCCL, Gloo and MPI do the same for ranks on one host.
//
// Who may use it: the receiver creates the segment (O_EXCL, mode 0600, owned by its user) under a name
// both sides derive from the job; the sender opens it only if its owner is the sender's own user, its
// mode lets no one else in, and its stamp (job, both ranks) is the one expected, then removes the name.
// So only a process of the same user, which can read that user's key files (~/.ringmaster) anyway, can
// feed or read it, and no bytes leave the host: the link needs no encryption. A sender that cannot open
// it (another host, another user, a name already taken) uses the network instead. Node daemons make
// segments only for a neighbour whose host_id() is theirs, and sweep_segments() removes those of dead
// processes (a daemon killed with SIGKILL leaves its segments behind).
//
// Segment layout: a control block (kControlBytes) and then `capacity` bytes of records. A record is a
// u64 length (a multiple of 64, counting itself), the 56-byte wire header (net/wire.hpp) and the payload,
// so payloads are 64-byte aligned; a length of kPadRecord skips to the start of the buffer. The sender
// owns `head` (bytes written), the receiver `tail` (bytes consumed); each waits on the other's futex word.
// The receiver copies every header out before it looks at it and checks every length against the buffer:
// whatever the other side writes, it can make us drop the link, never read astray. Payloads are lent, not
// copied (payload::lent): a record's space goes back to the sender once its reader and those of every
// record before it let go. A sender that writes into lent space changes only floats it sent itself.
//
// A sender may also lend the receiver memory of its own (net/shm_window.hpp: its replica's gradients).
// It offers the window in the control block; the receiver maps it read-only, or declines. Once it took
// it, a message whose bytes lie in the window and stay put until the receiver is done with them (the
// ring's in-place sends) goes as a reference record: the header and the bytes' offset, no copy. The
// receiver checks the offset against the window; the sender holds the message's owner until the
// record's space comes back, which says the receiver has let go of it.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "net/bridge.hpp"
#include "net/shm_window.hpp"
#include "net/wire.hpp"

namespace ringmaster::net {

// What a segment is for: both sides must agree on all of it.
struct shm_stamp {
  uint64_t job = 0;           // the ring's id (the chunks' job field)
  int32_t sender_rank = 0;    // the rank that sends on it
  int32_t receiver_rank = 0;  // its right neighbour, which receives
};

// 8 MiB: the ring's largest messages are 1 MiB (net/ring_driver.hpp), so seven fit, and the buffer takes
// little of a container's /dev/shm (64 MiB by default in Docker).
constexpr size_t kShmCapacity = size_t(8) << 20;
// The largest payload one message may carry: a quarter of the buffer, so a message always fits.
constexpr size_t kShmMaxPayload = kShmCapacity / 4;

// The segment's file name (under /dev/shm) for a stamp: our user's id, then a hash (SHA-256) of the ring
// and the receiving rank, which shows other local users neither.
std::string shm_name(const shm_stamp& s);
// Who could share a segment with us: this boot of this machine, its /dev/shm mount and our user
// ("<boot id>/<dev>.<inode>/<uid>"), or "" when unknown. Equal ids are worth trying; open() still decides.
std::string host_id();
// Removes our user's segments whose receiver is gone (it holds a lock on the segment while it lives).
// Returns how many.
int sweep_segments();

class shm_receiver {
 public:
  using handler = std::function<void(const wire::header&, payload)>;
  // Called once, on the receiving thread or a poller's, when the other side broke the segment's rules
  // (the link then stops taking messages).
  using error_handler = std::function<void(const std::string&)>;

  // Creates the segment. nullptr with *error when it cannot (the name is taken, no /dev/shm, no memory).
  static std::unique_ptr<shm_receiver> create(const shm_stamp& stamp, std::string* error);
  // Starts the thread that hands every message to h (on that thread, or a poller's: one at a time, in
  // order), its payload lent in place:
  // the sender writes over it only once the payload's owner and the owners of all before it are let go.
  // So hold a payload only briefly, or copy it (ring::driver does, for what it keeps).
  void start(handler h, error_handler e);
  // From a thread that waits for this link's messages (a replica whose all-reduce runs): takes and hands
  // on the messages itself, spinning, until done() or `until`, so that no thread has to be woken for
  // them. Returns done()'s last answer: at once if the receiving thread holds the link (it is looking
  // for records or handing one on, and goes on doing so) or the link is dead. The thread takes over
  // again after.
  bool poll(std::chrono::steady_clock::time_point until, const std::function<bool()>& done);
  // How often the thread waited its whole 100 ms and then, with no poll running, found a record: a
  // wake-up the sender or a poll that ended owed it and did not give. 0 unless the hand-over has a race
  // (the tests check it), or a sender stalled between writing a record and waking us just as the wait
  // ran out; a thread that was woken but waited for a core does not count.
  uint64_t missed_wakeups() const;
  // Stops and joins the thread (on the thread itself, from a handler: lets it end on its own, and it frees
  // what it holds), marks the segment closed (a sender then drops what it sends) and removes its name if
  // the sender has not. Not from a handler before start() has returned.
  ~shm_receiver();
  shm_receiver(const shm_receiver&) = delete;
  shm_receiver& operator=(const shm_receiver&) = delete;

  struct impl;

 private:
  explicit shm_receiver(std::unique_ptr<impl> d);
  std::unique_ptr<impl> d_;
};

class shm_sender {
 public:
  // Opens the segment a receiver created for this stamp. nullptr with *error when there is none (*missing:
  // no such name, the usual case on another host) or it is not ours alone or not for this stamp.
  static std::unique_ptr<shm_sender> open(const shm_stamp& stamp, std::string* error, bool* missing);
  // From any thread. Never waits for the receiver: the message is copied into the segment, or, when the
  // buffer is full, into a queue for the sender's thread, and then done with p's bytes when it returns.
  // in_place: p's bytes stay unchanged until p.owner is let go, so a message inside the lent window,
  // once the receiver has taken it, goes as a reference instead, and p.owner is held until the
  // receiver has read it. False with *error only for a message that can never go (a bad header, a
  // payload over kShmMaxPayload). Once the receiver has closed the segment, messages are dropped (and
  // owners let go), as a connection to a vanished peer drops them; the job's heartbeats tell who is gone.
  bool send(const wire::header& h, payload p, std::string* error, bool in_place = false);
  // Offers the receiver `w` to read in place (once; before or while messages flow). Until it has taken
  // it, and if it declines (another pid namespace, say), messages are copied as before.
  void lend(std::shared_ptr<shm_window> w);
  enum class window_state { none, offered, taken, declined };
  window_state lending() const;
  // The owners of referenced messages are held until the receiver let go of them. Whoever waits for
  // that (a replica polling for its all-reduce's end) calls reap() to let them go at once; while a
  // reaper exists, the sender's thread leaves that to it, else it sleeps until the receiver wakes it.
  void reap();
  // Someone waits for the held owners (ring::link::await_release): unless a reaper lets them go, the
  // sender's thread waits for the receiver and does.
  void await_release();
  class reaper {
   public:
    explicit reaper(shm_sender& s);
    ~reaper();
    reaper(const reaper&) = delete;
    reaper& operator=(const reaper&) = delete;

   private:
    shm_sender& s_;
  };
  // Referenced messages whose owners are still held; references written so far.
  size_t held() const;
  uint64_t references() const;
  // Drops what is still queued, lets go of what is held (on its own thread, from an owner it let go of:
  // once the thread ends, which it does at once).
  ~shm_sender();
  shm_sender(const shm_sender&) = delete;
  shm_sender& operator=(const shm_sender&) = delete;

  struct impl;

 private:
  explicit shm_sender(std::unique_ptr<impl> d);
  std::unique_ptr<impl> d_;
};

// For a thread that waits for an all-reduce whose chunks come through `in` (null: none to poll) and go
// out through `out`, which lends a window: polls `in` as shm_receiver::poll does, and meanwhile lets go
// of the owners of what the right neighbour has read (a reaper of `out` while it runs).
bool poll_reaping(shm_receiver* in, shm_sender& out, std::chrono::steady_clock::time_point until,
                  const std::function<bool()>& done);

}  // namespace ringmaster::net
