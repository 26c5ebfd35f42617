// Same-host collectives through one shared-memory segment (shm_comm.cpp; the Python side is
// distributed/shm_transport.py). After vLLM's CPU backend (csrc/cpu/shm.cpp): every local rank owns
// one slot per channel, writes what it sends there once and publishes a round number; its peers
// poll for it with acquire loads, copy (or sum) their part out and acknowledge. Per channel a
// worker thread runs the operations in issue order, so a caller issues and later waits, as on a
// gloo Work. An operation that is its channel's next when issued, with the slot free, writes and
// publishes its bytes at issue: a peer that waits for it first (DBO's other rank) finds them there,
// whatever this rank does meanwhile. A caller that waits for an operation the worker has not
// started runs the channel's queue itself, up to its operation, and saves the two thread hand-offs
// (caller to worker, worker back to caller); the worker runs an operation nobody waited for within
// a grace period of its issue (DBO: while the other ubatch computes), or at once when a caller
// waits behind it. Waits spin briefly, then sleep on a futex (the other processes wake it), so
// polling does not starve compute on a machine with few cores.

#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace moe_dbo_cpu {

constexpr int kShmMaxLocalRanks = 16;

// What one operation does with the bytes it receives (the reduce kinds sum them, in local rank
// order, with the op's dtype).
enum class ShmOpKind : uint32_t { kCopy = 1, kSum = 2 };

struct ShmOp {
  ShmOpKind kind;
  at::Tensor output, input;  // held until the worker is done with them
  // per local rank p: bytes of ``input`` p receives (offset, length), and where the bytes p
  // sends land in ``output`` (offset, expected length)
  std::vector<int64_t> send_offsets, send_lengths, recv_offsets, recv_lengths;
  int64_t issued_ns = 0;    // CLOCK_MONOTONIC
  int64_t deadline_ns = 0;  // CLOCK_MONOTONIC
  // the round this op published at issue (its first round's bytes are in this rank's slot
  // already), or 0: the thread that runs it publishes
  uint32_t published = 0;
  std::atomic<bool> awaited{false};  // a caller waits for it: the worker runs it at once
  std::atomic<uint32_t> state{0};  // 0 pending, 1 done, 2 failed (futex word)
  std::atomic<uint32_t> waiters{0};
  std::string error;
};

class ShmComm;
struct SlotHeader;  // one rank's slot of a channel (shm_comm.cpp)

// One operation in flight: what Python's Work-like handle wraps.
class ShmWork {
 public:
  ShmWork(std::shared_ptr<ShmOp> op, std::shared_ptr<ShmComm> comm, int64_t channel)
      : op_(std::move(op)), comm_(std::move(comm)), channel_(channel) {}
  // Blocks (GIL released) until done or ``timeout_s``; "" when done, else the error message
  // (starting with "timed out" for a timeout). Runs the operation on the calling thread when
  // the channel's worker has not started it.
  std::string wait(double timeout_s);
  bool is_completed() const;
  // Whether issue wrote and published its first round (the channel was idle and its slot free).
  bool published_at_issue() const { return op_->published != 0; }

 private:
  std::shared_ptr<ShmOp> op_;
  std::shared_ptr<ShmComm> comm_;  // keeps the segment mapped while the work can run
  int64_t channel_;
};

class ShmComm : public std::enable_shared_from_this<ShmComm> {
 public:
  // Maps segment ``name`` (creating it with ``segment_bytes`` when ``create``) for
  // ``num_local_ranks`` ranks, this one ``local_rank``; ``group_ranks``/``pids`` name each local
  // rank in errors and liveness checks.
  ShmComm(const std::string& name, bool create, int64_t num_local_ranks, int64_t local_rank,
          int64_t num_channels, int64_t capacity_bytes, std::vector<int64_t> group_ranks,
          std::vector<int64_t> pids);
  ~ShmComm();
  static int64_t segment_bytes(int64_t num_local_ranks, int64_t num_channels,
                               int64_t capacity_bytes);
  static void unlink(const std::string& name);

  std::shared_ptr<ShmWork> issue(int64_t channel, int64_t kind, at::Tensor output,
                                 at::Tensor input, std::vector<int64_t> send_offsets,
                                 std::vector<int64_t> send_lengths,
                                 std::vector<int64_t> recv_offsets,
                                 std::vector<int64_t> recv_lengths, double timeout_s);
  void close();
  // Runs ``channel``'s queued operations on the calling thread, in issue order, until ``op`` is
  // done, unless another thread is running that channel (then returns at once).
  void run_until(int64_t channel, const ShmOp& op);

 private:
  struct Channel;
  void run_channel(Channel* channel);
  // Runs the channel's first queued operation if it was issued before ``issued_before`` or is
  // awaited; false when none did. The caller holds channel->run_mutex.
  bool run_next(Channel* channel, int64_t issued_before);
  void run_op(Channel* channel, ShmOp& op);
  // How ``op`` cuts its bytes into rounds (see run_op).
  struct Layout {
    bool shared;
    int64_t chunk;
  };
  Layout layout(const ShmOp& op) const;
  SlotHeader* slot_header(int64_t channel, int64_t local_rank) const;
  // Writes round ``t``'s header and blocks of ``op`` (its first round, ``k`` 0) into this rank's
  // slot and publishes ``t``; the caller has seen every peer acknowledge round ``t - 1``.
  void publish(Channel* channel, const ShmOp& op, const Layout& layout, int64_t k, uint32_t t);
  // At issue, when ``op`` is its channel's next and the slot is free (every peer has read the
  // previous round): publishes its first round at once, so a peer that waits for it first finds
  // it without this rank's wait or worker.
  void try_publish_at_issue(Channel* channel, ShmOp& op);
  std::string wait_word(std::atomic<uint32_t>* word, std::atomic<uint32_t>* waiters,
                        uint32_t target, int64_t peer, int64_t deadline_ns, const char* what);
  void fail_all(const std::string& message);

  std::string name_;
  void* base_ = nullptr;
  int64_t bytes_ = 0;
  int64_t num_local_, local_rank_, num_channels_, capacity_;
  std::vector<int64_t> group_ranks_, pids_;
  std::vector<std::unique_ptr<Channel>> channels_;
  std::atomic<bool> closing_{false};  // close() stops waits on peers too
};

}  // namespace moe_dbo_cpu
