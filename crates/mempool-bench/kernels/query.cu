// Columnar operators of the query workload: generate, filter (flags, exclusive scan, compact), gather,
// hash join (build and probe, open addressing), hash group-by with atomics, LSD radix sort, and
// reductions. The host (src/workloads/query.rs) strings them into gpu-bdb-style pipelines, allocating
// every intermediate through the memory resource under test.
//
// Build: kernels/build-ptx.sh (nvcc -ptx -arch=compute_80; __match_any_sync needs sm_70 or newer).
// Launch shapes: one element per thread with 256-thread blocks unless a kernel says otherwise.
#include "common.cuh"

// The empty slot of a hash table (keys must never take this value).
#define EMPTY_KEY 0xffffffffu

// Scan tiles: 256 threads, 4 consecutive items each.
#define SCAN_THREADS 256
#define SCAN_ITEMS 4
#define SCAN_TILE (SCAN_THREADS * SCAN_ITEMS)

// Radix sort: 8-bit digits, 256 threads, 4 rounds of 256 consecutive items per tile.
#define RADIX_BITS 8
#define RADIX_DIGITS (1 << RADIX_BITS)
#define SORT_THREADS 256
#define SORT_WARPS (SORT_THREADS / 32)
#define SORT_ROUNDS 4
#define SORT_TILE (SORT_THREADS * SORT_ROUNDS)

// ---------------------------------------------------------------------------------------------------
// Generation and element-wise operators

// out[i] = lo + hash2(seed, i) % span (span 0: the full 32-bit hash, lo ignored).
extern "C" __global__ void q_gen_u32(u32* out, u64 n, u32 seed, u32 lo, u32 span) {
    u64 i = global_index();
    if (i < n) {
        u32 h = hash2(seed, i);
        out[i] = span == 0u ? h : lo + h % span;
    }
}

// out[i] = base + i.
extern "C" __global__ void q_iota_u32(u32* out, u64 n, u32 base) {
    u64 i = global_index();
    if (i < n) {
        out[i] = base + (u32)i;
    }
}

// flags[i] = lo <= col[i] < hi.
extern "C" __global__ void q_flags_range(const u32* col, u64 n, u32 lo, u32 hi, u32* flags) {
    u64 i = global_index();
    if (i < n) {
        u32 v = col[i];
        flags[i] = (v >= lo && v < hi) ? 1u : 0u;
    }
}

// flags[i] &= other[i].
extern "C" __global__ void q_flags_and(u32* flags, const u32* other, u64 n) {
    u64 i = global_index();
    if (i < n) {
        flags[i] &= other[i];
    }
}

// flags[i] = (i == 0 || sorted[i] != sorted[i - 1]): the first row of each run of equal keys.
extern "C" __global__ void q_flags_head(const u32* sorted, u64 n, u32* flags) {
    u64 i = global_index();
    if (i < n) {
        flags[i] = (i == 0 || sorted[i] != sorted[i - 1]) ? 1u : 0u;
    }
}

// flags[i] = table_keys[i] != EMPTY_KEY.
extern "C" __global__ void q_flags_occupied(const u32* table_keys, u64 n, u32* flags) {
    u64 i = global_index();
    if (i < n) {
        flags[i] = table_keys[i] != EMPTY_KEY ? 1u : 0u;
    }
}

// out[i] = a[i] * b[i] (wrapping).
extern "C" __global__ void q_mul_u32(const u32* a, const u32* b, u64 n, u32* out) {
    u64 i = global_index();
    if (i < n) {
        out[i] = a[i] * b[i];
    }
}

// out[i] = a[i] * mul + b[i] (wrapping): composite keys.
extern "C" __global__ void q_combine_u32(const u32* a, const u32* b, u64 n, u32 mul, u32* out) {
    u64 i = global_index();
    if (i < n) {
        out[i] = a[i] * mul + b[i];
    }
}

// ---------------------------------------------------------------------------------------------------
// Exclusive scan (three kernels; the host recurses over the tile sums)

// out[i] = sum of in[t*1024 .. i) within i's tile t of SCAN_TILE items; block_sums[t] = the tile's sum
// (when block_sums is not null). 256 threads per block, ceil(n / 1024) blocks. `out` must not alias `in`.
extern "C" __global__ void q_scan_block(const u32* in, u32* out, u64 n, u32* block_sums) {
    __shared__ u32 warp_totals[SCAN_THREADS / 32];
    u32 lane = threadIdx.x & 31u;
    u32 warp = threadIdx.x >> 5;
    u64 base = (u64)blockIdx.x * SCAN_TILE + (u64)threadIdx.x * SCAN_ITEMS;
    u32 v[SCAN_ITEMS];
    u32 thread_sum = 0;
    for (int k = 0; k < SCAN_ITEMS; k++) {
        v[k] = (base + k < n) ? in[base + k] : 0u;
        thread_sum += v[k];
    }
    // Inclusive scan of the thread sums within the warp.
    u32 x = thread_sum;
    for (int off = 1; off < 32; off <<= 1) {
        u32 y = __shfl_up_sync(FULL_MASK, x, off);
        if (lane >= (u32)off) {
            x += y;
        }
    }
    if (lane == 31) {
        warp_totals[warp] = x;
    }
    __syncthreads();
    // Inclusive scan of the warp totals by warp 0 (each lane reads and writes only its own slot).
    if (warp == 0) {
        u32 t = lane < SCAN_THREADS / 32 ? warp_totals[lane] : 0u;
        for (int off = 1; off < 32; off <<= 1) {
            u32 y = __shfl_up_sync(FULL_MASK, t, off);
            if (lane >= (u32)off) {
                t += y;
            }
        }
        if (lane < SCAN_THREADS / 32) {
            warp_totals[lane] = t;
        }
    }
    __syncthreads();
    u32 running = (warp > 0 ? warp_totals[warp - 1] : 0u) + x - thread_sum;
    for (int k = 0; k < SCAN_ITEMS; k++) {
        if (base + k < n) {
            out[base + k] = running;
        }
        running += v[k];
    }
    if (threadIdx.x == SCAN_THREADS - 1 && block_sums != 0) {
        block_sums[blockIdx.x] = warp_totals[SCAN_THREADS / 32 - 1];
    }
}

// data[i] += tile_offsets[i / SCAN_TILE]: turns tile-local scans into a global one.
extern "C" __global__ void q_scan_add(u32* data, u64 n, const u32* tile_offsets) {
    u64 i = global_index();
    if (i < n) {
        data[i] += tile_offsets[i / SCAN_TILE];
    }
}

// total[0] = offsets[n - 1] + flags[n - 1] (n > 0): the number of rows a compaction keeps.
// One thread.
extern "C" __global__ void q_scan_total(const u32* flags, const u32* offsets, u64 n, u32* total) {
    if (global_index() == 0) {
        total[0] = n == 0 ? 0u : offsets[n - 1] + flags[n - 1];
    }
}

// ---------------------------------------------------------------------------------------------------
// Compaction and gather

// out[offsets[i]] = in[i] where flags[i].
extern "C" __global__ void q_compact_u32(const u32* in, const u32* flags, const u32* offsets, u64 n, u32* out) {
    u64 i = global_index();
    if (i < n && flags[i]) {
        out[offsets[i]] = in[i];
    }
}

// out[offsets[i]] = in[i] where flags[i], for 64-bit values.
extern "C" __global__ void q_compact_u64(const u64* in, const u32* flags, const u32* offsets, u64 n, u64* out) {
    u64 i = global_index();
    if (i < n && flags[i]) {
        out[offsets[i]] = in[i];
    }
}

// out[offsets[i]] = i where flags[i]: the row indices a filter keeps.
extern "C" __global__ void q_compact_index(const u32* flags, const u32* offsets, u64 n, u32* out) {
    u64 i = global_index();
    if (i < n && flags[i]) {
        out[offsets[i]] = (u32)i;
    }
}

// out[j] = col[idx[j]] for j < m.
extern "C" __global__ void q_gather_u32(const u32* col, const u32* idx, u64 m, u32* out) {
    u64 j = global_index();
    if (j < m) {
        out[j] = col[idx[j]];
    }
}

// ---------------------------------------------------------------------------------------------------
// Hash join: open addressing with linear probing; capacity a power of two, `mask` = capacity - 1;
// table_keys filled with EMPTY_KEY beforehand.

// Inserts (keys[i], i) for i < n. Build keys must be unique.
extern "C" __global__ void q_hash_build(const u32* keys, u64 n, u32* table_keys, u32* table_rows, u32 mask) {
    u64 i = global_index();
    if (i >= n) {
        return;
    }
    u32 k = keys[i];
    u32 slot = mix32(k) & mask;
    while (true) {
        u32 prev = atomicCAS(&table_keys[slot], EMPTY_KEY, k);
        if (prev == EMPTY_KEY || prev == k) {
            table_rows[slot] = (u32)i;
            return;
        }
        slot = (slot + 1u) & mask;
    }
}

// For each probe key: flags[i] = whether it is in the table, build_rows[i] = the matching build row.
extern "C" __global__ void q_hash_probe(const u32* keys, u64 n, const u32* table_keys, const u32* table_rows,
                                        u32 mask, u32* build_rows, u32* flags) {
    u64 i = global_index();
    if (i >= n) {
        return;
    }
    u32 k = keys[i];
    u32 slot = mix32(k) & mask;
    while (true) {
        u32 t = table_keys[slot];
        if (t == k) {
            build_rows[i] = table_rows[slot];
            flags[i] = 1u;
            return;
        }
        if (t == EMPTY_KEY) {
            build_rows[i] = 0u;
            flags[i] = 0u;
            return;
        }
        slot = (slot + 1u) & mask;
    }
}

// ---------------------------------------------------------------------------------------------------
// Hash group-by: sums (64-bit) and counts per key, with atomics. table_keys filled with EMPTY_KEY,
// sums and counts with zero beforehand; capacity a power of two above the number of distinct keys.

extern "C" __global__ void q_groupby_sum(const u32* keys, const u32* vals, u64 n, u32* table_keys,
                                         u64* table_sums, u32* table_counts, u32 mask) {
    u64 i = global_index();
    if (i >= n) {
        return;
    }
    u32 k = keys[i];
    u32 slot = mix32(k) & mask;
    while (true) {
        u32 prev = atomicCAS(&table_keys[slot], EMPTY_KEY, k);
        if (prev == EMPTY_KEY || prev == k) {
            break;
        }
        slot = (slot + 1u) & mask;
    }
    atomicAdd(&table_sums[slot], (u64)vals[i]);
    atomicAdd(&table_counts[slot], 1u);
}

// ---------------------------------------------------------------------------------------------------
// LSD radix sort of u32 keys (with optional u32 values), 8 bits per pass. Per pass:
//   q_radix_hist (ceil(n / SORT_TILE) blocks of 256) -> hist[digit * nblocks + block]
//   exclusive scan of hist (RADIX_DIGITS * nblocks entries) -> offsets
//   q_radix_scatter (same grid) -> keys_out / vals_out, stable.

extern "C" __global__ void q_radix_hist(const u32* keys, u64 n, u32 shift, u32* hist, u32 nblocks) {
    __shared__ u32 counts[RADIX_DIGITS];
    for (u32 d = threadIdx.x; d < RADIX_DIGITS; d += blockDim.x) {
        counts[d] = 0u;
    }
    __syncthreads();
    u64 start = (u64)blockIdx.x * SORT_TILE;
    for (int r = 0; r < SORT_ROUNDS; r++) {
        u64 i = start + (u64)r * SORT_THREADS + threadIdx.x;
        if (i < n) {
            atomicAdd(&counts[(keys[i] >> shift) & (RADIX_DIGITS - 1)], 1u);
        }
    }
    __syncthreads();
    for (u32 d = threadIdx.x; d < RADIX_DIGITS; d += blockDim.x) {
        hist[(u64)d * nblocks + blockIdx.x] = counts[d];
    }
}

// Stable scatter: within a tile, rows keep their order (round by round, warp by warp, lane by lane).
// `vals` and `vals_out` may both be null (keys only).
extern "C" __global__ void q_radix_scatter(const u32* keys, const u32* vals, u64 n, u32 shift, const u32* offsets,
                                           u32* keys_out, u32* vals_out, u32 nblocks) {
    __shared__ u32 base[RADIX_DIGITS];
    __shared__ u32 warp_counts[SORT_WARPS][RADIX_DIGITS];
    u32 lane = threadIdx.x & 31u;
    u32 warp = threadIdx.x >> 5;
    for (u32 d = threadIdx.x; d < RADIX_DIGITS; d += SORT_THREADS) {
        base[d] = offsets[(u64)d * nblocks + blockIdx.x];
    }
    u64 start = (u64)blockIdx.x * SORT_TILE;
    for (int r = 0; r < SORT_ROUNDS; r++) {
        for (u32 j = threadIdx.x; j < SORT_WARPS * RADIX_DIGITS; j += SORT_THREADS) {
            warp_counts[j / RADIX_DIGITS][j % RADIX_DIGITS] = 0u;
        }
        __syncthreads();
        u64 i = start + (u64)r * SORT_THREADS + threadIdx.x;
        bool valid = i < n;
        u32 key = valid ? keys[i] : 0u;
        u32 digit = (key >> shift) & (RADIX_DIGITS - 1);
        // Lanes with the same digit (invalid lanes form their own group, RADIX_DIGITS is no digit).
        u32 peers = __match_any_sync(FULL_MASK, valid ? digit : (u32)RADIX_DIGITS);
        u32 rank = __popc(peers & ((1u << lane) - 1u));
        u32 leader = __ffs(peers) - 1;
        if (valid && lane == leader) {
            warp_counts[warp][digit] = __popc(peers);
        }
        __syncthreads();
        if (valid) {
            u32 pos = base[digit] + rank;
            for (u32 w = 0; w < warp; w++) {
                pos += warp_counts[w][digit];
            }
            keys_out[pos] = key;
            if (vals != 0) {
                vals_out[pos] = vals[i];
            }
        }
        __syncthreads();
        for (u32 d = threadIdx.x; d < RADIX_DIGITS; d += SORT_THREADS) {
            u32 s = 0;
            for (u32 w = 0; w < SORT_WARPS; w++) {
                s += warp_counts[w][d];
            }
            base[d] += s;
        }
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------------------------------
// Reductions and checks (grid-stride: any grid size works)

// *out += sum of vals[0..n).
extern "C" __global__ void q_sum_u32(const u32* vals, u64 n, u64* out) {
    u64 s = 0;
    for (u64 i = global_index(); i < n; i += grid_stride()) {
        s += vals[i];
    }
    block_sum_to(s, out);
}

// *out += sum of vals[0..n).
extern "C" __global__ void q_sum_u64(const u64* vals, u64 n, u64* out) {
    u64 s = 0;
    for (u64 i = global_index(); i < n; i += grid_stride()) {
        s += vals[i];
    }
    block_sum_to(s, out);
}

// *out += the number of i in 1..n with keys[i - 1] > keys[i].
extern "C" __global__ void q_count_unsorted(const u32* keys, u64 n, u64* out) {
    u64 s = 0;
    for (u64 i = global_index() + 1; i < n; i += grid_stride()) {
        s += keys[i - 1] > keys[i] ? 1ull : 0ull;
    }
    block_sum_to(s, out);
}
