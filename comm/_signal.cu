// Signals between the ranks of one node, in stream order, through words in peer-mapped memory.
// The protocol (docs/design.md, "Signals on the device"): a 64-bit word holds a generation in its
// high 32 bits and, for "ready" words, the 32-bit kind of the exchange in its low 32 bits.
// Generations compare modulo 2^32. Every wait gives up after timeout_ns of %globaltimer, or at once
// once another wait has failed, writing what it missed into `status` (pinned host memory):
// status[0] code (1 timeout, 2 kind mismatch), [1] peer, [2] expected, [3] seen.

typedef unsigned long long u64;
typedef unsigned int u32;

__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ bool reached(u32 have, u32 want) { return (int)(have - want) >= 0; }

__device__ void report(volatile u32* status, u32 code, u32 peer, u32 expected, u32 seen) {
    if (atomicCAS((u32*)status, 0u, 0xFFFFFFFFu) == 0u) {
        status[1] = peer;
        status[2] = expected;
        status[3] = seen;
        __threadfence_system();
        status[0] = code;
        __threadfence_system();
    }
}

// Open the next generation: wait until every peer's "done" word of this rank reached the current
// generation (its reads of this rank's staging are over), then advance the counter.
// Launch: one block of at least `size` threads.
extern "C" __global__ void mx_begin(u32* gen, const u64* done, int size, int rank,
                                    u64 timeout_ns, u32* status) {
    int p = threadIdx.x;
    u32 current = gen[0];
    if (p < size && p != rank) {
        const volatile u64* word = done + p;
        const volatile u32* failed = status;
        u64 start = now_ns();
        while (!reached((u32)(*word >> 32), current)) {
            if (*failed) break;
            if (now_ns() - start > timeout_ns) {
                report(status, 1, p, current, (u32)(*word >> 32));
                break;
            }
            __nanosleep(128);
        }
    }
    __syncthreads();
    if (p == 0) gen[0] = current + 1;
}

// Write (generation << 32) into the word at each of `count` addresses (one per peer).
// Launch: one block of at least `count` threads.
extern "C" __global__ void mx_signal_all(const u32* gen, const u64* addresses, int count) {
    int i = threadIdx.x;
    if (i < count) {
        __threadfence_system();
        atomicExch((u64*)addresses[i], (u64)gen[0] << 32);
    }
}

// The words of one or several peers (up to MX_BATCH): one launch for all of them.
#define MX_BATCH 8
struct PeerWords {
    u64 word[MX_BATCH];   // addresses of the 64-bit words
    u32 kind[MX_BATCH];   // the kind written into / expected in each
    u32 peer[MX_BATCH];   // the peer each word is about (for a failed wait's report)
};

// Write (generation << 32 | kind) into each of `count` peers' words, after everything this stream
// wrote before. Launch: one block of at least `count` threads.
extern "C" __global__ void mx_signal(const u32* gen, PeerWords w, int count) {
    int i = threadIdx.x;
    if (i < count) {
        __threadfence_system();
        atomicExch((u64*)w.word[i], ((u64)gen[0] << 32) | w.kind[i]);
    }
}

// Wait until each of `count` local words holds this generation (one thread each), then check its
// kind: the stream goes on once every word has arrived, or one wait failed (timed out, or a kind
// differs; reported in `status`). Launch: one block of at least `count` threads.
extern "C" __global__ void mx_wait(const u32* gen, PeerWords w, int count, u64 timeout_ns,
                                   u32* status) {
    int i = threadIdx.x;
    if (i < count) {
        u32 current = gen[0];
        const volatile u64* word = (const u64*)w.word[i];
        const volatile u32* failed = status;
        u64 start = now_ns();
        while (true) {
            u64 value = *word;
            if ((u32)(value >> 32) == current) {
                if ((u32)value != w.kind[i]) report(status, 2, w.peer[i], w.kind[i], (u32)value);
                break;
            }
            if (*failed) break;
            if (now_ns() - start > timeout_ns) {
                report(status, 1, w.peer[i], current, (u32)(value >> 32));
                break;
            }
            __nanosleep(64);
        }
    }
    __syncthreads();
    __threadfence_system();
}
