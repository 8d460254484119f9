#pragma once
// The two-stage layer pipeline (DESIGN.md section 4): a decode step's layers
// split over two devices, each stage a captured model_decode over its own
// cache, the hidden state carried between them by the copy engines. Where
// the devices cannot reach each other (GeForce cards on PCIe) a transfer is
// staged through pinned host memory: a device-to-host copy on the sender's
// copy stream, a host-to-device copy on the receiver's stream; elsewhere
// (one device, or peers) it is one copy. No SM time is spent on transport,
// and the host never waits: a step is graph launches, copies and event
// waits. On one device the two stages are two streams standing in for the
// two GPUs.
//
// Ordering, per transfer from stage a to stage b (events, reused each step):
//  - the copy waits for stage a's step (its source is written there);
//  - a direct copy waits for stage b's previous step (its destination is
//    read there); a staged one waits for the previous host-to-device copy
//    (the staging buffer is read there), which stage b's stream orders
//    before its stage;
//  - stage b's step waits for the copy; stage a's next step waits for the
//    copy's read of its source.
// The feedback transfer (stage 1's output into stage 0's next input, e.g.
// the last hidden state to the embedding of the next token) is optional.

#include <cstddef>
#include <string>

#include <cuda_runtime_api.h>

#include "hisparse/core/status.hpp"
#include "hisparse/runtime/model_decode.cuh"

namespace hisparse {

/// One buffer carried from one stage's device to the other's each step.
struct pipeline_transfer {
  const void* src = nullptr;  ///< on the sending stage's device, written by its step
  void* dst = nullptr;        ///< on the receiving stage's device, read by its step
  std::size_t bytes = 0;      ///< 0: no transfer (only for the feedback)
  void* host = nullptr;       ///< pinned staging of >= bytes, or nullptr for a direct copy
};

template <class T, tile_policy Tile = attention::kDecodeTile, class KV = T>
class layer_pipeline {
 public:
  using stage_decode = model_decode<T, Tile, KV>;

  /// A stage: its decode (captured, i.e. warmed up, on `device`) and two
  /// streams created on that device.
  struct stage {
    int device = 0;
    const stage_decode* decode = nullptr;
    cudaStream_t compute = nullptr;  ///< the stage's graph and incoming host-to-device copies
    cudaStream_t copy = nullptr;     ///< the stage's outgoing copies
  };

  layer_pipeline() = default;
  ~layer_pipeline() { destroy_events(); }
  layer_pipeline(const layer_pipeline&) = delete;
  layer_pipeline& operator=(const layer_pipeline&) = delete;

  /// Checks the stages and transfers and makes the events; nothing is
  /// enqueued. `forward` carries stage 0's output to stage 1; `feedback`
  /// (bytes 0: none) stage 1's output to stage 0's next step.
  [[nodiscard]] status plan(const stage& first, const stage& second, const pipeline_transfer& forward,
                            const pipeline_transfer& feedback = {}) {
    auto bad = [](const std::string& why) { return fail(status::invalid_argument, "layer pipeline: " + why); };
    for (const stage* s : {&first, &second}) {
      if (s->decode == nullptr || s->decode->layers() == 0) return bad("a stage has no planned decode");
      if (s->compute == nullptr || s->copy == nullptr || s->compute == s->copy)
        return bad("a stage needs two created streams (compute and copy), not the legacy default");
    }
    if (first.compute == second.compute) return bad("the stages share a compute stream: nothing would overlap");
    if (forward.bytes == 0) return bad("the forward transfer is empty");
    for (const pipeline_transfer* x : {&forward, &feedback})
      if (x->bytes != 0 && (x->src == nullptr || x->dst == nullptr))
        return bad("a transfer needs a source and a destination");
    if (first.device != second.device)
      for (const pipeline_transfer* x : {&forward, &feedback})
        if (x->bytes != 0 && x->host == nullptr) {
          int peer = 0;
          HISPARSE_CUDA_TRY(cudaDeviceCanAccessPeer(&peer, first.device, second.device));
          if (peer == 0)
            return bad("devices " + std::to_string(first.device) + " and " + std::to_string(second.device) +
                       " cannot reach each other: give the transfer pinned host staging");
        }
    destroy_events();
    stages_[0] = first;
    stages_[1] = second;
    transfers_[0] = forward;
    transfers_[1] = feedback;
    steps_ = 0;
    for (int s = 0; s < 2; ++s) {
      device_scope on(stages_[s].device);
      HISPARSE_TRY(on.result);
      HISPARSE_CUDA_TRY(cudaEventCreateWithFlags(&done_[s], cudaEventDisableTiming));
      HISPARSE_CUDA_TRY(cudaEventCreateWithFlags(&sent_[s], cudaEventDisableTiming));
      HISPARSE_CUDA_TRY(cudaEventCreateWithFlags(&received_[1 - s], cudaEventDisableTiming));  // recorded here
    }
    return status::success;
  }

  /// Enqueues one step: stage 0, the forward transfer, stage 1, the
  /// feedback. Returns without waiting for any of it.
  [[nodiscard]] status step() {
    if (done_[0] == nullptr) return fail(status::invalid_argument, "layer pipeline: step before plan");
    // Transfer x goes from stage x to stage 1 - x; sent_[x] and received_[x]
    // are its events, done_[s] stage s's step.
    for (int s = 0; s < 2; ++s) {
      const stage& st = stages_[s];
      device_scope on(st.device);
      HISPARSE_TRY(on.result);
      const int in = 1 - s;  // the transfer this stage receives
      if (active(in) && (s == 1 || steps_ > 0)) HISPARSE_TRY(receive(in));
      if (active(s) && steps_ > 0)  // its source is rewritten below: the last step's copy must have read it
        HISPARSE_CUDA_TRY(cudaStreamWaitEvent(st.compute, sent_[s], 0));
      HISPARSE_TRY(st.decode->replay(st.compute));
      HISPARSE_CUDA_TRY(cudaEventRecord(done_[s], st.compute));
      if (active(s)) HISPARSE_TRY(send(s));
    }
    ++steps_;
    return status::success;
  }

  /// Waits for every step enqueued so far.
  [[nodiscard]] status synchronize() const {
    for (const stage& st : stages_) {
      device_scope on(st.device);
      HISPARSE_TRY(on.result);
      HISPARSE_CUDA_TRY(cudaStreamSynchronize(st.compute));
      HISPARSE_CUDA_TRY(cudaStreamSynchronize(st.copy));
    }
    return status::success;
  }

  [[nodiscard]] long steps() const { return steps_; }

 private:
  /// Makes `device` current for a scope and restores the caller's.
  struct device_scope {
    int previous = 0;
    status result = status::success;
    explicit device_scope(int device) {
      if (cudaGetDevice(&previous) != cudaSuccess || cudaSetDevice(device) != cudaSuccess)
        result = fail(status::cuda_error, "layer pipeline: cannot make device " + std::to_string(device) + " current");
    }
    ~device_scope() { cudaSetDevice(previous); }
  };

  [[nodiscard]] bool active(int x) const { return transfers_[x].bytes != 0; }

  /// Transfer x, its sender's side (after done_[x] is recorded).
  [[nodiscard]] status send(int x) {
    const pipeline_transfer& t = transfers_[x];
    const stage& from = stages_[x];
    HISPARSE_CUDA_TRY(cudaStreamWaitEvent(from.copy, done_[x], 0));
    if (t.host != nullptr) {
      // The staging buffer is free once the last host-to-device copy read
      // it (an event never recorded is no wait).
      HISPARSE_CUDA_TRY(cudaStreamWaitEvent(from.copy, received_[x], 0));
      HISPARSE_CUDA_TRY(cudaMemcpyAsync(t.host, t.src, t.bytes, cudaMemcpyDeviceToHost, from.copy));
    } else {
      // The destination is free once the receiver's last step read it.
      HISPARSE_CUDA_TRY(cudaStreamWaitEvent(from.copy, done_[1 - x], 0));
      HISPARSE_CUDA_TRY(cudaMemcpyPeerAsync(t.dst, stages_[1 - x].device, t.src, from.device, t.bytes, from.copy));
    }
    HISPARSE_CUDA_TRY(cudaEventRecord(sent_[x], from.copy));
    return status::success;
  }

  /// Transfer x, its receiver's side, before the receiving stage's step.
  [[nodiscard]] status receive(int x) {
    const pipeline_transfer& t = transfers_[x];
    const stage& to = stages_[1 - x];
    HISPARSE_CUDA_TRY(cudaStreamWaitEvent(to.compute, sent_[x], 0));
    if (t.host != nullptr) {
      HISPARSE_CUDA_TRY(cudaMemcpyAsync(t.dst, t.host, t.bytes, cudaMemcpyHostToDevice, to.compute));
      HISPARSE_CUDA_TRY(cudaEventRecord(received_[x], to.compute));
    }
    return status::success;
  }

  void destroy_events() noexcept {
    for (cudaEvent_t* set : {done_, sent_, received_})
      for (int s = 0; s < 2; ++s)
        if (set[s] != nullptr) {
          cudaEventDestroy(set[s]);
          set[s] = nullptr;
        }
  }

  stage stages_[2]{};
  pipeline_transfer transfers_[2]{};
  cudaEvent_t done_[2]{}, sent_[2]{}, received_[2]{};
  long steps_ = 0;
};

}  // namespace hisparse
