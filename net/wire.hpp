// The versioned wire format between ringmaster processes.
//
// A message is a multipart ZeroMQ message: one fixed-size header frame (little-endian, packed byte by byte
// so the layout never depends on the compiler) and, optionally, one raw payload frame. For float tensors
// (chunk, weights) the payload is `elements` IEEE floats in the host's byte order, sent without copying.
//
// Header layout (kHeaderSize = 56 bytes):
//   0  u32 magic         kMagic ("RMG1")            the first 8 bytes are the stable part: every future
//   4  u16 version       kProtocolVersion           version keeps magic, version and type where they are,
//   6  u16 type          msg_type                   so a peer can always say "you speak version N".
//   8  u64 job_id        the job the message belongs to (0 before there is one, e.g. a launcher's hello)
//  16  i64 step          training step / all-reduce number, >= 0 (chunks; in a steps message the last
//                        record's step, for logs: the records say theirs)
//  24  i32 sender_rank   the ring rank the message is about, >= -1 (-1: none): the sending rank for
//                        chunk, report, done and weights from a node; the rank addressed by a
//                        launcher's start and weights request
//  28  i32 round         ring round of a chunk (with kFlagWhole: hops from its origin); the piece of
//                        a weights or checkpoint buffer (below); >= 0; 0 in every other message
//  32  i32 segment       which segment of a chunk (with kFlagWhole: the origin rank), >= 0
//  36  u32 flags         kFlagWhole or 0; other bits must be 0
//  40  u64 elements      floats in the payload (tensor messages); records (steps)
//  48  u64 payload_bytes size of the payload frame (0: no payload frame)
//
// Weights and checkpoint buffers travel in pieces of kPieceFloats floats, in order, the last one the
// rest: `round` numbers them, `elements` counts this piece's floats. A peer's messages behind a buffer
// then wait for one piece, not for the whole model, so its heartbeats keep coming.
//
// Payloads: chunk, weights and checkpoint carry floats; job and reform a JSON job plan (actors/job_plan.hpp,
// at most kMaxJobBytes); hello, hello_ack, job_ack, report, abort, error, pause and weights_sum key=value text
// (kMaxKvBytes; the bridge's refusal of another version is plain text), a report naming its kind
// ("kind=eval", "kind=paused", "kind=held" or "kind=stall"); steps `elements` step records; start, done, heartbeat
// and bye nothing. A chunk's job_id is its ring's id: the job's, until a lost node makes the launcher
// re-form the ring (actors/reform.hpp).
//
// Step record (kStepRecordBytes = 88, little-endian like the header; what a replica reports after each
// step, actors/messages.hpp's step_report; a node sends those of every step, so they go in batches, not
// one key=value message each, which cost the launcher more than a core's tenth in a fast job):
//   0  i32 rank   4 i32 gen      8 i64 epoch     16 i64 step      24 f64 loss_sum   32 i64 correct
//  40  i64 count 48 f64 wait_batch              56 f64 compute   64 f64 wait_ring  72 f64 update
//  80  u64 state_sum (at a checkpoint's step: the rank's state_checksum, actors/messages.hpp; else 0)
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <type_traits>

namespace ringmaster::wire {

constexpr uint32_t kMagic = 0x524D4731;  // "RMG1"
// 2: jobs name their device kind, nodes may offer GPUs. 3: jobs are JSON plans; a start message; reports
// name their kind in the payload and weights their rank in sender_rank, so round is only a ring round.
// 4: elastic jobs: pause and reform messages, reports name their ring generation, plans their ring.
// 5: plans name each node's sealed port and a seal salt: ring chunks between nodes may be sealed
// (net/seal.hpp) and then carry a trailer frame. 6: plans say whether nodes on one host may send ring
// chunks through shared memory (net/shm_link.hpp). 7: lost nodes rejoin (a pause may name the step to
// stop after; a checkpoint message without payload asks a paused rank for its state; plans past
// generation 0 may be jobs, with ranks that join); job_ack says the parameter count. 8: plans say each
// node's life in the job, which goes into its pair keys: a node that rejoins seals again. 9: ring chunks
// are sealed with AES-128-OCB, not AES-256-GCM (a node of version 8 could not open them). 10: a plan's
// sealed_port is its ring_port, which nodes started --insecure have too: ring chunks between their hosts
// go there, plain (net/tcp_link.hpp), not through the bridge. 11: job_ack says the training set's
// data_fingerprint (train_data); a plan may start at its job's last step (a finished run resumed).
// 12: step reports travel as binary records, many to a steps message. 13: weights and checkpoint
// buffers travel in pieces (a launcher took a node for lost while 950 MB of weights came in one message).
// 14: a launcher asks every rank but one for a checksum of its final weights (weights_sum), not for all of
// them: 16 ranks of a 237M-parameter model sent it 15 GB, held at once.
// 15: a pause may hold the ranks (for=hold, answered by kind=held reports), so that a job on nodes
// stopped by a signal writes a checkpoint where it stops whether its replicas update by bucket or not;
// weights_sum is FNV-1a from FNV's own offset basis (before, one a digit short of it). 16: step records
// carry the rank's state checksum at a checkpoint's step, to check rank 0's state against. 17: a stall
// report says whether a link between nodes closed under the ring (link=1), which a launcher re-forms.
constexpr uint16_t kProtocolVersion = 17;
constexpr size_t kHeaderSize = 56;
constexpr uint64_t kMaxPayloadBytes = uint64_t(1) << 30;  // 1 GiB: larger tensors go in several messages
constexpr size_t kMaxKvBytes = 64 * 1024;                 // control payloads are small
// A job plan: a model description of up to 64 KiB and 1024 ranks and nodes fit with room to spare.
constexpr size_t kMaxJobBytes = 1024 * 1024;
constexpr uint64_t kPieceFloats = uint64_t(1) << 22;  // 16 MiB: tens of ms on a link, even over CurveZMQ
constexpr size_t kStepRecordBytes = 88;
constexpr uint64_t kMaxStepRecords = 4096;  // in one steps message

// chunk flag: the payload is rank `segment`'s whole buffer, `round` hops from its origin (the
// small-buffer all-reduce); without it a chunk is one ring round of one piece.
constexpr uint32_t kFlagWhole = 1;
constexpr uint32_t kKnownFlags = kFlagWhole;

enum class msg_type : uint16_t {
  hello = 1,   // handshake: "I am rank r of n in job j" (kv payload)
  hello_ack,   // handshake accepted
  job,         // a job plan (JSON payload)
  job_ack,
  chunk,       // a piece of a ring all-reduce (float payload)
  report,      // metrics (kv payload)
  done,
  weights,     // model weights (float payload); from a launcher, without payload: a request for them
  heartbeat,
  abort,       // the sender gave up on the job (kv payload: origin, reason)
  error,       // a refusal, e.g. a protocol version mismatch (text payload)
  bye,
  start,       // the launcher's go for rank sender_rank, once every node has taken the job (or a reform)
  // One buffer of a training state after `step` steps (float payload), `segment` saying which: 0 the
  // weights, 1 Adam's first moment or SGD's velocity, 2 Adam's second moment. From a node: rank
  // sender_rank's, for a checkpoint or asked for; from a launcher: the state a resumed job or a node
  // that rejoins starts from, or the one paused ranks a step behind go on from. From a launcher without
  // payload: a request for paused rank sender_rank's state.
  checkpoint,
  // The ring is re-formed (or the job stops, with for=stop): stop (after step `at` if given), say how far
  // (kv payload: gen[, at][, for]). With for=hold (a signal's stop, round one): start no further step
  // and say how many were started (kind=held reports); the pause for generation gen follows.
  pause,
  reform,      // continue in a re-formed ring (JSON plan of the new generation); answered by job_ack
  steps,       // step reports, `elements` records in order (binary payload, above)
  // Rank sender_rank's final weights as a checksum, which is all a launcher needs of every rank but one
  // (kv payload: fnv1a64, the FNV-1a of their bytes in decimal, and finite, 1 or 0). From a launcher
  // without payload: a request for it.
  weights_sum,
};
constexpr uint16_t kFirstType = 1, kLastType = uint16_t(msg_type::weights_sum);
constexpr int32_t kStateBuffers = 3;  // checkpoint segments: 0..2

const char* type_name(msg_type t);
bool is_known_type(uint16_t t);
// Types whose payload is `elements` floats.
bool is_tensor_type(msg_type t);

struct header {
  uint16_t version = kProtocolVersion;  // written as is by encode (tests forge other versions)
  msg_type type = msg_type::heartbeat;
  uint64_t job_id = 0;
  int64_t step = 0;
  int32_t sender_rank = -1;
  int32_t round = 0;
  int32_t segment = 0;
  uint32_t flags = 0;
  uint64_t elements = 0;
  uint64_t payload_bytes = 0;
};

using header_bytes = std::array<unsigned char, kHeaderSize>;

// Explicit little-endian packing of one integer: the layout is the same whatever the host's byte order or
// padding.
template <class T>
void put_le(unsigned char* p, T v) {
  using U = std::make_unsigned_t<T>;
  const U u = static_cast<U>(v);
  for (size_t i = 0; i < sizeof(T); ++i) p[i] = static_cast<unsigned char>(u >> (8 * i));
}
template <class T>
T get_le(const unsigned char* p) {
  using U = std::make_unsigned_t<T>;
  U u = 0;
  for (size_t i = 0; i < sizeof(T); ++i) u |= static_cast<U>(U(p[i]) << (8 * i));
  return static_cast<T>(u);
}

header_bytes encode(const header& h);

// Checks every field of a header as if it had been received (the bridge also checks what it sends).
bool validate(const header& h, std::string* error);

// Decodes and validates one header frame. On failure returns false, leaves *out unspecified and says
// what is wrong in *error: "header frame is 12 bytes, expected 56", "bad magic 0x...", "protocol version
// 2, this build speaks 1", "unknown message type 99", ...
bool decode(const void* data, size_t size, header* out, std::string* error);

// The stable 8-byte prefix alone, for answering a peer that speaks another version. False if the frame
// is too short or the magic is wrong.
bool peek_version(const void* data, size_t size, uint16_t* version, uint16_t* type);

// The payload frame that came with a header must be exactly payload_bytes long.
bool check_payload(const header& h, size_t actual_bytes, std::string* error);

// A received multipart message, a ROUTER's identity frame already taken off, and what to do with it.
// Pure (no sockets), so that tests and the fuzzer (tests/fuzz/fuzz_frames.cpp) check what the bridge does.
struct frame {
  const void* data = nullptr;
  size_t size = 0;
};
enum class verdict {
  accept,          // one valid header frame and, if it says so, a payload frame exactly as long
  malformed,       // drop it: wrong number of frames, a bad header, a payload of the wrong size
  other_version,   // drop it: the peer speaks another protocol version (*error names both)
  answer_version,  // as other_version, and it is a hello: answer with an error message (never an error)
};
// `count` frames came; frames[0] and, when count is 2, frames[1] are given (more frames are refused
// unread). On accept, *out is the decoded header; otherwise *error says why.
verdict check_message(const frame* frames, size_t count, header* out, std::string* error);

// Control payloads: "key=value\n" lines. Keys are non-empty and hold no '=' or newline; values hold no
// newline; the whole text is at most kMaxKvBytes; a key appears once.
using kv_map = std::map<std::string, std::string>;
bool encode_kv(const kv_map& kv, std::string* out, std::string* error);
bool decode_kv(std::string_view text, kv_map* out, std::string* error);

}  // namespace ringmaster::wire
