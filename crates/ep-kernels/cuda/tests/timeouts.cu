// Test kernels for the meaning of a timeout: 0 is the default bound in every EP kernel (as in the
// protocol), and a wait stops early once another wait of its rank has recorded an error.
#include <cstdint>

#include "ep/device.cuh"

// out[0] = the bound a wait with `timeout_ns` uses.
extern "C" __global__ void timeouts_bound_of(uint64_t timeout_ns, uint64_t* out) {
    if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = ibgda_wait_bound_ns(timeout_ns);
}

// One block waits, through ep::wait_for_peers, for `epoch` from rank 0 of a group of 1 at
// `signal` (a SignalHead), bounded by `timeout_ns`, reporting to the ErrorSlot at `error`.
// out[0] = 1 if the wait returned true, 0 if false; out[1] = the ns it took.
extern "C" __global__ void timeouts_wait_for_peers(uint64_t signal, uint64_t epoch, uint64_t timeout_ns,
                                                   uint64_t error, uint64_t* out) {
    __shared__ uint64_t signals[1];
    if (threadIdx.x == 0) signals[0] = signal;
    __syncthreads();
    const uint64_t t0 = ep::globaltimer_ns();
    const bool ok = ep::wait_for_peers(signals, 0, 1, epoch, timeout_ns, error, 0u);
    if (threadIdx.x == 0) {
        out[0] = ok ? 1u : 0u;
        out[1] = ep::globaltimer_ns() - t0;
    }
}

// Sleeps `ns` (by %globaltimer), then stores `value` to `*out`: legacy-stream work that a bounded
// wait must give up on, and that a download queued after it must still see.
extern "C" __global__ void timeouts_sleep_then_store(uint64_t ns, uint64_t* out, uint64_t value) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const uint64_t start = ep::globaltimer_ns();
    while (ep::globaltimer_ns() - start < ns) __nanosleep(1000);
    ep::st_release_sys(out, value);
}
