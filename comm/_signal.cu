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

// The result arrays of an exchange (up to 4), poisoned where it failed.
struct Results {
    u64 ptr[4];
    u64 bytes[4];
};

// Fill the `count` arrays of `out` with 0xFF bytes (NaN in bf16, fp32, e4m3 and e8m0), grid-
// stride over the launch: a failed exchange's results, so no row of another call is used.
__device__ void poison(Results out, int count) {
    u64 stride = (u64)gridDim.x * blockDim.x;
    for (int i = 0; i < count; ++i) {
        unsigned char* p = (unsigned char*)out.ptr[i];
        for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < out.bytes[i]; j += stride)
            p[j] = 0xFF;
    }
}

// End an exchange: block 0 writes (generation << 32) into the word at each of `count` addresses
// (this rank's "done" in each peer's flags); where a wait of this rank failed (`status` set: a
// peer late, or at another call or kind of exchange), every block poisons the `nout` results,
// which the copies after that wait filled from the wrong rows.
// Launch: blocks of at least `count` threads (one block where `nout` is 0).
extern "C" __global__ void mx_end(const u32* gen, const u64* addresses, int count,
                                  const u32* status, Results out, int nout) {
    int i = threadIdx.x;
    if (blockIdx.x == 0 && i < count) {
        __threadfence_system();
        atomicExch((u64*)addresses[i], (u64)gen[0] << 32);
    }
    __shared__ u32 failed;  // one read of the pinned status per block
    if (i == 0) failed = *(const volatile u32*)status;
    __syncthreads();
    if (failed) poison(out, nout);
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

// ---- The NCCL backend's call header (_header.py): MX_HEADER_WORDS 32-bit words a rank sends each
// peer it moves rows with, in the same NCCL group as the rows: what identifies the call and its
// rows (words 0 .. MX_HEADER_WORDS - 2), then MX_HEADER_MAGIC (a header received this call).
#define MX_HEADER_WORDS 8
#define MX_HEADER_MAGIC 0x4D584844u

// This rank's header, by value.
struct Header {
    u32 word[MX_HEADER_WORDS - 1];
};

// Write this rank's header into `header` and clear the `size` headers of `received` (a peer
// that sends none this call leaves zeros, not checked). Launch: one block (any width).
extern "C" __global__ void mx_header_put(u32* header, u32* received, int size, Header mine) {
    int t = threadIdx.x;
    if (t < MX_HEADER_WORDS - 1) header[t] = mine.word[t];
    if (t == 0) header[MX_HEADER_WORDS - 1] = MX_HEADER_MAGIC;
    for (int i = t; i < MX_HEADER_WORDS * size; i += blockDim.x) received[i] = 0;
}

// Compare each header received this call (MX_HEADER_WORDS words per rank in `received`) with
// this rank's. Where one differs: report the first such peer in `status` (code 3; [1] peer,
// then its words, then this rank's: 2 + 2 * (MX_HEADER_WORDS - 1) words) and fill the `count`
// result arrays with 0xFF bytes (NaN in bf16, fp32, e4m3 and e8m0), so no row of another call is
// used. Every block reads the headers itself (no grid-wide sync). Launch: any grid and width.
extern "C" __global__ void mx_header_check(const u32* received, int size, Header mine,
                                           u32* status, Results out, int count) {
    __shared__ int bad;
    if (threadIdx.x == 0) {
        bad = -1;
        for (int p = 0; p < size && bad < 0; ++p) {
            const u32* h = received + MX_HEADER_WORDS * p;
            if (h[MX_HEADER_WORDS - 1] != MX_HEADER_MAGIC) continue;
            for (int k = 0; k < MX_HEADER_WORDS - 1; ++k)
                if (h[k] != mine.word[k]) bad = p;
        }
        if (bad >= 0 && blockIdx.x == 0 && atomicCAS(status, 0u, 0xFFFFFFFFu) == 0u) {
            const u32* h = received + MX_HEADER_WORDS * bad;
            volatile u32* s = status;
            s[1] = bad;
            for (int k = 0; k < MX_HEADER_WORDS - 1; ++k) {
                s[2 + k] = h[k];
                s[1 + MX_HEADER_WORDS + k] = mine.word[k];
            }
            __threadfence_system();
            s[0] = 3;
            __threadfence_system();
        }
    }
    __syncthreads();
    if (bad >= 0) poison(out, count);
}
