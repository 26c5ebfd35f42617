// Same-host collectives through a shared-memory segment (contract in shm_comm.h and
// distributed/shm_transport.py).
//
// Segment layout: a 4 KiB header (abort flag and message), then per channel and local rank one
// slot: a 4 KiB slot header (round flag, one ack word per peer, what the round carries) and
// ``capacity`` bytes of data. An operation runs in rounds (all ranks the same number): in round
// t a rank waits until every peer has acknowledged round t - 1 of its slot, writes its chunk
// there, publishes ``ready = t`` (release), waits for every peer's ``ready == t`` (acquire),
// copies or sums its part of each peer's chunk and stores ``ack[me] = t`` in each peer's slot.
// A per-destination block is cut in chunks of ``chunk`` bytes: round k carries bytes
// [k * chunk, (k + 1) * chunk) of each block, packed at ``dst * chunk`` (or once, at 0, when
// every destination reads the same bytes: all_gather, all_reduce).

#include "shm_comm.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <fcntl.h>
#include <sched.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace moe_dbo_cpu {
namespace {

constexpr int64_t kPage = 4096;
constexpr int64_t kSpinNs = 20'000;          // spin this long before sleeping on a futex
constexpr int64_t kSleepSliceNs = 20'000'000;  // then wake at least this often to check liveness
// A worker leaves an op this long to a caller's wait: a shorter grace wakes the worker between a
// caller's back-to-back ops, and on a 2-core machine those wake-ups cost more than the exchange.
constexpr int64_t kGraceNs = 1'000'000;
constexpr int64_t kAny = INT64_MAX;  // run_next: whatever is queued

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

// One step of a spin: a pause at first, then a yield, so that a thread that spins on a busy core
// (2 cores, 2 ranks, each with a caller and a channel thread) hands it to a runnable peer thread.
inline void relax(int64_t& step) {
  if (step++ < 64) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  } else {
    sched_yield();
  }
}

// Futexes: ``shared`` words live in the segment (other processes wake them).
void futex_wait(std::atomic<uint32_t>* word, uint32_t seen, int64_t timeout_ns, bool shared) {
  timespec ts{time_t(timeout_ns / 1'000'000'000), long(timeout_ns % 1'000'000'000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), shared ? FUTEX_WAIT : FUTEX_WAIT_PRIVATE,
          seen, &ts, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word, bool shared) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), shared ? FUTEX_WAKE : FUTEX_WAKE_PRIVATE,
          INT32_MAX, nullptr, nullptr, 0);
}

// Whether process ``pid`` has exited (gone, or a zombie its parent has not reaped yet).
bool has_exited(int64_t pid) {
  if (kill(pid_t(pid), 0) != 0) return errno == ESRCH;
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return false;
  char buffer[512];
  const ssize_t n = ::read(fd, buffer, sizeof(buffer) - 1);
  ::close(fd);
  if (n <= 0) return false;
  buffer[n] = 0;
  const char* end = std::strrchr(buffer, ')');  // "pid (comm) S ...": the state follows comm
  return end != nullptr && end[1] == ' ' && (end[2] == 'Z' || end[2] == 'X');
}

// Whether ``a`` has reached ``b`` on a wrapping round counter.
inline bool reached(uint32_t a, uint32_t b) { return int32_t(a - b) >= 0; }

struct alignas(64) Word {
  std::atomic<uint32_t> value;
  std::atomic<uint32_t> waiters;
};

struct SegmentHeader {
  Word abort;  // value 1: a rank failed; message says which and why
  char message[1024];
};

static_assert(sizeof(SegmentHeader) <= kPage, "segment header");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be lock free");

int64_t slot_stride(int64_t capacity) { return kPage + (capacity + kPage - 1) / kPage * kPage; }

// dst[i] = sum over s of srcs[s][i] (in order), n elements of T; half types summed in float.
template <typename T>
void sum_into(T* dst, const std::vector<const char*>& srcs, int64_t n) {
  using V = at::vec::Vectorized<T>;
  int64_t i = 0;
  for (; i + V::size() <= n; i += V::size()) {
    V acc = V::loadu(reinterpret_cast<const T*>(srcs[0]) + i);
    for (size_t s = 1; s < srcs.size(); ++s) acc = acc + V::loadu(reinterpret_cast<const T*>(srcs[s]) + i);
    acc.store(dst + i);
  }
  for (; i < n; ++i) {
    T acc = reinterpret_cast<const T*>(srcs[0])[i];
    for (size_t s = 1; s < srcs.size(); ++s) acc += reinterpret_cast<const T*>(srcs[s])[i];
    dst[i] = acc;
  }
}

template <typename H>  // c10::BFloat16 or c10::Half: accumulate in float, round once
void sum_into_half(H* dst, const std::vector<const char*>& srcs, int64_t n) {
  using V = at::vec::Vectorized<float>;
  constexpr int64_t kStep = 2 * V::size();
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    V a0, a1, b0, b1;
    if constexpr (std::is_same_v<H, c10::BFloat16>) {
      at::vec::load_fp32_from_bf16(reinterpret_cast<const H*>(srcs[0]) + i, a0, a1);
    } else {
      at::vec::load_fp32_from_fp16(reinterpret_cast<const H*>(srcs[0]) + i, a0, a1);
    }
    for (size_t s = 1; s < srcs.size(); ++s) {
      if constexpr (std::is_same_v<H, c10::BFloat16>) {
        at::vec::load_fp32_from_bf16(reinterpret_cast<const H*>(srcs[s]) + i, b0, b1);
      } else {
        at::vec::load_fp32_from_fp16(reinterpret_cast<const H*>(srcs[s]) + i, b0, b1);
      }
      a0 = a0 + b0;
      a1 = a1 + b1;
    }
    if constexpr (std::is_same_v<H, c10::BFloat16>) {
      at::vec::convert_float_bfloat16(a0, a1).store(dst + i);
    } else {
      at::vec::convert_float_half(a0, a1).store(dst + i);
    }
  }
  for (; i < n; ++i) {
    float acc = float(reinterpret_cast<const H*>(srcs[0])[i]);
    for (size_t s = 1; s < srcs.size(); ++s) acc += float(reinterpret_cast<const H*>(srcs[s])[i]);
    dst[i] = H(acc);
  }
}

void sum_bytes(at::ScalarType dtype, char* dst, const std::vector<const char*>& srcs,
               int64_t num_bytes) {
  switch (dtype) {
    case at::kFloat: return sum_into(reinterpret_cast<float*>(dst), srcs, num_bytes / 4);
    case at::kDouble: return sum_into(reinterpret_cast<double*>(dst), srcs, num_bytes / 8);
    case at::kLong: return sum_into(reinterpret_cast<int64_t*>(dst), srcs, num_bytes / 8);
    case at::kInt: return sum_into(reinterpret_cast<int32_t*>(dst), srcs, num_bytes / 4);
    case at::kBFloat16:
      return sum_into_half(reinterpret_cast<c10::BFloat16*>(dst), srcs, num_bytes / 2);
    case at::kHalf: return sum_into_half(reinterpret_cast<c10::Half*>(dst), srcs, num_bytes / 2);
    default: throw std::runtime_error("shm sum: unsupported dtype");
  }
}

}  // namespace

struct SlotHeader {
  Word ready;                    // the last round published in this slot
  Word ack[kShmMaxLocalRanks];   // ack[p]: the last round local rank p read from this slot
  alignas(64) uint32_t kind;     // ShmOpKind
  int32_t dtype;                 // c10::ScalarType (sums)
  int64_t chunk;                 // bytes of each destination's block per round
  int64_t shared;                // 1: every destination reads one block, packed once at 0
  int64_t send_lengths[kShmMaxLocalRanks];  // bytes of the block for each local rank
};
static_assert(sizeof(SlotHeader) <= kPage, "slot header");

struct ShmComm::Channel {
  int64_t index = 0;
  std::thread thread;
  std::mutex mutex;      // guards queue and stop
  std::mutex run_mutex;  // held by the thread running this channel's operations (worker or caller)
  std::condition_variable cv;
  std::deque<std::shared_ptr<ShmOp>> queue;
  bool stop = false;
  bool idle = false;  // the worker sleeps until an op is queued (issue wakes it)
  uint32_t round = 0;
  std::string fatal;  // set by the first failure: every later op fails with it
};

// ---------------------------------------------------------------------------------------------
// ShmWork

std::string ShmWork::wait(double timeout_s) {
  ShmOp& op = *op_;
  if (op.state.load(std::memory_order_acquire) == 0) {
    op.awaited.store(true);  // the worker, if it holds the channel, runs it next
    comm_->run_until(channel_, op);
  }
  const int64_t start = now_ns();
  const int64_t deadline = start + int64_t(timeout_s * 1e9);
  int64_t step = 0;
  while (op.state.load(std::memory_order_acquire) == 0 && now_ns() - start < kSpinNs) relax(step);
  while (op.state.load(std::memory_order_acquire) == 0) {
    const int64_t remaining = deadline - now_ns();
    if (remaining <= 0) {
      return "timed out after " + std::to_string(timeout_s) +
             " s waiting for a shared-memory collective";
    }
    op.waiters.fetch_add(1);  // blocking wait (futex, the caller's timeout)
    if (op.state.load() == 0) futex_wait(&op.state, 0, std::min(remaining, kSleepSliceNs), false);
    op.waiters.fetch_sub(1);
  }
  return op.state.load() == 1 ? std::string() : op.error;
}

bool ShmWork::is_completed() const { return op_->state.load(std::memory_order_acquire) != 0; }

// ---------------------------------------------------------------------------------------------
// ShmComm

int64_t ShmComm::segment_bytes(int64_t num_local_ranks, int64_t num_channels,
                               int64_t capacity_bytes) {
  return kPage + num_channels * num_local_ranks * slot_stride(capacity_bytes);
}

void ShmComm::unlink(const std::string& name) { shm_unlink(name.c_str()); }

ShmComm::ShmComm(const std::string& name, bool create, int64_t num_local_ranks,
                 int64_t local_rank, int64_t num_channels, int64_t capacity_bytes,
                 std::vector<int64_t> group_ranks, std::vector<int64_t> pids)
    : name_(name),
      num_local_(num_local_ranks),
      local_rank_(local_rank),
      num_channels_(num_channels),
      capacity_(capacity_bytes),
      group_ranks_(std::move(group_ranks)),
      pids_(std::move(pids)) {
  if (num_local_ < 1 || num_local_ > kShmMaxLocalRanks || local_rank_ < 0 ||
      local_rank_ >= num_local_ || num_channels_ < 1 || capacity_ < kPage ||
      int64_t(group_ranks_.size()) != num_local_ || int64_t(pids_.size()) != num_local_) {
    throw std::invalid_argument("ShmComm: bad layout (at most 16 local ranks, capacity >= 4 KiB)");
  }
  bytes_ = segment_bytes(num_local_, num_channels_, capacity_);
  const int fd = create ? shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600)
                        : shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) {
    throw std::runtime_error("shm_open(" + name + "): " + std::strerror(errno));
  }
  if (create && ftruncate(fd, bytes_) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    shm_unlink(name.c_str());
    throw std::runtime_error("ftruncate(" + name + "): " + why);
  }
  base_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base_ == MAP_FAILED) {
    base_ = nullptr;
    throw std::runtime_error("mmap(" + name + "): " + std::strerror(errno));
  }
  for (int64_t c = 0; c < num_channels_; ++c) {
    auto channel = std::make_unique<Channel>();
    channel->index = c;
    channels_.push_back(std::move(channel));
  }
  for (auto& channel : channels_) {
    Channel* raw = channel.get();
    raw->thread = std::thread([this, raw] { run_channel(raw); });
  }
}

ShmComm::~ShmComm() { close(); }

void ShmComm::close() {
  closing_.store(true);
  for (auto& channel : channels_) {
    {
      std::lock_guard<std::mutex> lock(channel->mutex);
      channel->stop = true;
    }
    channel->cv.notify_all();
  }
  for (auto& channel : channels_) {
    if (channel->thread.joinable()) channel->thread.join();
    std::lock_guard<std::mutex> run(channel->run_mutex);  // a caller running an op is done
    while (run_next(channel.get(), kAny)) {  // fail what is left: "the communicator was closed"
    }
  }
  if (base_ != nullptr) {
    munmap(base_, bytes_);
    base_ = nullptr;
  }
}

std::shared_ptr<ShmWork> ShmComm::issue(int64_t channel_index, int64_t kind, at::Tensor output,
                                        at::Tensor input, std::vector<int64_t> send_offsets,
                                        std::vector<int64_t> send_lengths,
                                        std::vector<int64_t> recv_offsets,
                                        std::vector<int64_t> recv_lengths, double timeout_s) {
  if (channel_index < 0 || channel_index >= int64_t(channels_.size())) {
    throw std::invalid_argument("ShmComm.issue: no such channel");
  }
  if (closing_.load()) throw std::runtime_error("ShmComm.issue: the communicator was closed");
  const size_t n = size_t(num_local_);
  if (send_offsets.size() != n || send_lengths.size() != n || recv_offsets.size() != n ||
      recv_lengths.size() != n || (kind != 1 && kind != 2) || !output.is_contiguous() ||
      !input.is_contiguous() || !output.device().is_cpu() || !input.device().is_cpu()) {
    throw std::invalid_argument(
        "ShmComm.issue: contiguous CPU tensors and one offset and length per local rank");
  }
  const int64_t in_bytes = input.numel() * int64_t(input.element_size());
  const int64_t out_bytes = output.numel() * int64_t(output.element_size());
  for (size_t p = 0; p < n; ++p) {
    if (send_offsets[p] < 0 || send_lengths[p] < 0 || send_offsets[p] + send_lengths[p] > in_bytes ||
        recv_offsets[p] < 0 || recv_lengths[p] < 0 ||
        recv_offsets[p] + recv_lengths[p] > out_bytes) {
      throw std::invalid_argument("ShmComm.issue: an offset or length is outside its tensor");
    }
  }
  auto op = std::make_shared<ShmOp>();
  op->kind = ShmOpKind(kind);
  op->output = std::move(output);
  op->input = std::move(input);
  op->send_offsets = std::move(send_offsets);
  op->send_lengths = std::move(send_lengths);
  op->recv_offsets = std::move(recv_offsets);
  op->recv_lengths = std::move(recv_lengths);
  op->issued_ns = now_ns();
  op->deadline_ns = op->issued_ns + int64_t(timeout_s * 1e9);
  Channel& channel = *channels_[channel_index];
  // Holding run_mutex, nobody runs this channel: an op that lands first in the queue stays its
  // next until the lock is released, so its first round may be published here.
  std::unique_lock<std::mutex> run(channel.run_mutex, std::try_to_lock);
  bool wake = false, first = false;
  {
    std::lock_guard<std::mutex> lock(channel.mutex);
    // channel.fatal is written under run_mutex: read it only when holding that
    first = run.owns_lock() && channel.queue.empty() && channel.fatal.empty() && !channel.stop;
    channel.queue.push_back(op);
    wake = channel.idle;
    channel.idle = false;
  }
  if (first) try_publish_at_issue(&channel, *op);
  if (run.owns_lock()) run.unlock();
  if (wake) channel.cv.notify_one();
  return std::make_shared<ShmWork>(op, shared_from_this(), channel_index);
}

void ShmComm::try_publish_at_issue(Channel* channel, ShmOp& op) {
  if (num_local_ == 1) return;
  auto* header = static_cast<SegmentHeader*>(base_);
  if (header->abort.value.load() != 0) return;
  SlotHeader* mine = slot_header(channel->index, local_rank_);
  const uint32_t t = channel->round + 1;
  for (int64_t p = 0; p < num_local_; ++p) {  // a peer still reading: the runner publishes
    if (p != local_rank_ && !reached(mine->ack[p].value.load(std::memory_order_acquire), t - 1)) {
      return;
    }
  }
  channel->round = t;
  publish(channel, op, layout(op), 0, t);
  op.published = t;
}

void ShmComm::run_channel(Channel* channel) {
  while (true) {
    {
      std::unique_lock<std::mutex> lock(channel->mutex);
      while (!channel->stop && channel->queue.empty()) {
        channel->idle = true;
        channel->cv.wait_for(lock, std::chrono::seconds(1));  // blocking wait: the next op
      }
      channel->idle = false;
      if (channel->stop && channel->queue.empty()) return;
      const ShmOp& front = *channel->queue.front();
      const int64_t wait = front.issued_ns + kGraceNs - now_ns();
      if (!channel->stop && wait > 0 && !front.awaited.load()) {
        // blocking wait (bounded by the grace period): a caller may run it first
        channel->cv.wait_for(lock, std::chrono::nanoseconds(wait));
        continue;
      }
    }
    std::lock_guard<std::mutex> run(channel->run_mutex);  // a caller may be running the channel
    run_next(channel, now_ns() - kGraceNs);
  }
}

void ShmComm::run_until(int64_t channel_index, const ShmOp& op) {
  Channel* channel = channels_[size_t(channel_index)].get();
  std::unique_lock<std::mutex> run(channel->run_mutex, std::try_to_lock);
  if (!run.owns_lock()) return;  // the worker (or another caller) is running this channel
  while (op.state.load(std::memory_order_acquire) == 0 && run_next(channel, kAny)) {
  }
}

bool ShmComm::run_next(Channel* channel, int64_t issued_before) {
  std::shared_ptr<ShmOp> op;
  {
    std::lock_guard<std::mutex> lock(channel->mutex);
    if (channel->queue.empty()) return false;
    op = channel->queue.front();
    if (op->issued_ns >= issued_before && !op->awaited.load() && !channel->stop) return false;
    channel->queue.pop_front();
    if (channel->stop && channel->fatal.empty()) channel->fatal = "the communicator was closed";
  }
  if (channel->fatal.empty()) {
    try {
      run_op(channel, *op);
    } catch (const std::exception& e) {
      channel->fatal = e.what();
      fail_all(channel->fatal);
    }
  }
  if (!channel->fatal.empty()) op->error = channel->fatal;
  op->output.reset();  // release the tensors before the caller sees completion
  op->input.reset();
  op->state.store(channel->fatal.empty() ? 1 : 2, std::memory_order_release);
  if (op->waiters.load() > 0) futex_wake(&op->state, false);
  return true;
}

void ShmComm::fail_all(const std::string& message) {
  auto* header = static_cast<SegmentHeader*>(base_);
  uint32_t expected = 0;
  if (header->abort.value.compare_exchange_strong(expected, 1)) {
    const std::string text = "rank " + std::to_string(group_ranks_[local_rank_]) + ": " + message;
    std::strncpy(header->message, text.c_str(), sizeof(header->message) - 1);
  }
}

std::string ShmComm::wait_word(std::atomic<uint32_t>* word, std::atomic<uint32_t>* waiters,
                               uint32_t target, int64_t peer, int64_t deadline_ns,
                               const char* what) {
  const int64_t spin_until = now_ns() + kSpinNs;
  int64_t step = 0;
  while (!reached(word->load(std::memory_order_acquire), target)) {
    const int64_t now = now_ns();
    if (now < spin_until) {
      relax(step);
      continue;
    }
    if (closing_.load()) return "the communicator was closed";
    auto* header = static_cast<SegmentHeader*>(base_);
    if (header->abort.value.load() != 0) {
      return std::string("a peer failed (") + header->message + ")";
    }
    const int64_t rank = group_ranks_[peer];
    if (now >= deadline_ns) {
      return "timed out waiting for rank " + std::to_string(rank) + " to " + what +
             " (it is stuck, dead or issued a different collective)";
    }
    if (has_exited(pids_[peer])) {
      return "rank " + std::to_string(rank) + " (pid " + std::to_string(pids_[peer]) +
             ") exited during a shared-memory collective";
    }
    waiters->fetch_add(1);  // blocking wait (futex slice; the op's deadline bounds the loop)
    const uint32_t seen = word->load();
    if (!reached(seen, target)) {
      futex_wait(word, seen, std::min(deadline_ns - now, kSleepSliceNs), true);
    }
    waiters->fetch_sub(1);
  }
  return std::string();
}

ShmComm::Layout ShmComm::layout(const ShmOp& op) const {
  // One block for every destination (all_gather, all_reduce): written once per round.
  const int64_t n = num_local_, me = local_rank_;
  bool shared = true;
  for (int64_t p = 0; p < n; ++p) {
    for (int64_t q = 0; q < n; ++q) {
      if (p != me && q != me && q != p &&
          (op.send_offsets[p] != op.send_offsets[q] || op.send_lengths[p] != op.send_lengths[q])) {
        shared = false;
      }
    }
  }
  return Layout{shared, shared ? capacity_ : capacity_ / n / 64 * 64};
}

SlotHeader* ShmComm::slot_header(int64_t channel, int64_t p) const {
  return reinterpret_cast<SlotHeader*>(static_cast<char*>(base_) + kPage +
                                       (channel * num_local_ + p) * slot_stride(capacity_));
}

void ShmComm::publish(Channel* channel, const ShmOp& op, const Layout& layout, int64_t k,
                      uint32_t t) {
  const int64_t n = num_local_, me = local_rank_;
  SlotHeader* mine = slot_header(channel->index, me);
  char* data = reinterpret_cast<char*>(mine) + kPage;
  const char* in = static_cast<const char*>(op.input.data_ptr());
  if (k == 0) {
    mine->kind = uint32_t(op.kind);
    mine->dtype = int32_t(op.input.scalar_type());
    mine->chunk = layout.chunk;
    mine->shared = layout.shared;
    for (int64_t p = 0; p < n; ++p) mine->send_lengths[p] = op.send_lengths[p];
  }
  for (int64_t p = 0; p < n; ++p) {
    if (p == me || (layout.shared && p != (me + 1) % n)) continue;
    const int64_t begin = k * layout.chunk;
    const int64_t len = std::min(op.send_lengths[p], begin + layout.chunk) - begin;
    if (len > 0) {
      std::memcpy(data + (layout.shared ? 0 : p * layout.chunk), in + op.send_offsets[p] + begin,
                  len);
    }
  }
  mine->ready.value.store(t, std::memory_order_seq_cst);
  if (mine->ready.waiters.load(std::memory_order_seq_cst) > 0) futex_wake(&mine->ready.value, true);
}

void ShmComm::run_op(Channel* channel, ShmOp& op) {
  const int64_t n = num_local_, me = local_rank_;
  auto slot = [&](int64_t p) { return slot_header(channel->index, p); };
  auto data = [&](int64_t p) { return reinterpret_cast<char*>(slot(p)) + kPage; };
  auto check = [](const std::string& error) {
    if (!error.empty()) throw std::runtime_error(error);
  };
  char* out = static_cast<char*>(op.output.data_ptr());
  const char* in = static_cast<const char*>(op.input.data_ptr());
  const bool is_sum = op.kind == ShmOpKind::kSum;
  if (!is_sum) {  // this rank's own block never leaves the process
    if (op.send_lengths[me] != op.recv_lengths[me]) {
      throw std::runtime_error("this rank sends itself " + std::to_string(op.send_lengths[me]) +
                               " bytes but expects " + std::to_string(op.recv_lengths[me]));
    }
    if (op.send_lengths[me] > 0) {
      std::memmove(out + op.recv_offsets[me], in + op.send_offsets[me], op.send_lengths[me]);
    }
  }
  if (n == 1) {
    if (is_sum) std::memmove(out + op.recv_offsets[0], in + op.send_offsets[0], op.send_lengths[0]);
    return;
  }
  const Layout plan = layout(op);
  const int64_t chunk = plan.chunk;
  int64_t num_rounds = 1;
  std::vector<int64_t> recv_chunk(n, chunk), recv_at(n, 0);
  for (int64_t k = 0; k < num_rounds; ++k) {
    const bool at_issue = k == 0 && op.published != 0;  // published by issue already
    const uint32_t t = at_issue ? op.published : ++channel->round;
    if (!at_issue) {
      SlotHeader* mine = slot(me);
      for (int64_t p = 0; p < n; ++p) {  // peers are done reading the previous round
        if (p != me) {
          check(wait_word(&mine->ack[p].value, &mine->ack[p].waiters, t - 1, p, op.deadline_ns,
                          "read the previous round"));
        }
      }
      publish(channel, op, plan, k, t);
    }
    for (int64_t p = 0; p < n; ++p) {
      if (p == me) continue;
      SlotHeader* theirs = slot(p);
      check(wait_word(&theirs->ready.value, &theirs->ready.waiters, t, p, op.deadline_ns,
                      "join the collective"));
      if (k > 0) continue;
      const std::string from = "rank " + std::to_string(group_ranks_[p]);
      if (theirs->kind != uint32_t(op.kind) ||
          (is_sum && theirs->dtype != int32_t(op.input.scalar_type()))) {
        throw std::runtime_error(from + " issued a different collective or dtype");
      }
      const int64_t expected = is_sum ? op.send_lengths[me] : op.recv_lengths[p];
      if (theirs->send_lengths[me] != expected) {
        throw std::runtime_error(from + " sends " + std::to_string(theirs->send_lengths[me]) +
                                 " bytes, this rank expects " + std::to_string(expected) +
                                 " (split sizes differ across ranks)");
      }
      recv_chunk[p] = theirs->chunk;
      recv_at[p] = theirs->shared ? 0 : me * theirs->chunk;
      if (is_sum && recv_chunk[p] != chunk) {
        throw std::runtime_error(from + " cuts its blocks differently (a different collective)");
      }
      for (int64_t q = 0; q < n; ++q) {  // every rank takes the max over the same (p, q) pairs
        if (q != p && theirs->send_lengths[q] > 0) {
          num_rounds = std::max(num_rounds, (theirs->send_lengths[q] + theirs->chunk - 1) /
                                                theirs->chunk);
        }
      }
    }
    if (k == 0) {
      for (int64_t p = 0; p < n; ++p) {
        if (p != me && op.send_lengths[p] > 0) {
          num_rounds = std::max(num_rounds, (op.send_lengths[p] + chunk - 1) / chunk);
        }
      }
    }
    if (is_sum) {
      const int64_t begin = k * chunk, len = std::min(op.send_lengths[me], begin + chunk) - begin;
      if (len > 0) {
        std::vector<const char*> srcs(n);
        for (int64_t p = 0; p < n; ++p) {
          srcs[p] = p == me ? in + op.send_offsets[me] + begin : data(p) + recv_at[p];
        }
        sum_bytes(op.input.scalar_type(), out + op.recv_offsets[me] + begin, srcs, len);
      }
    } else {
      for (int64_t p = 0; p < n; ++p) {
        if (p == me) continue;
        const int64_t begin = k * recv_chunk[p];
        const int64_t len = std::min(op.recv_lengths[p], begin + recv_chunk[p]) - begin;
        if (len > 0) std::memcpy(out + op.recv_offsets[p] + begin, data(p) + recv_at[p], len);
      }
    }
    for (int64_t p = 0; p < n; ++p) {
      if (p == me) continue;
      Word& ack = slot(p)->ack[me];
      ack.value.store(t, std::memory_order_seq_cst);
      if (ack.waiters.load(std::memory_order_seq_cst) > 0) futex_wake(&ack.value, true);
    }
  }
}

}  // namespace moe_dbo_cpu
