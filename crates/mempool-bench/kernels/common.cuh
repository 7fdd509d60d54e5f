// Shared device helpers of the mempool-bench kernels. The host side (src/kernels.rs, `mix32` and
// `hash2`) computes the same functions bit for bit, so results can be checked on the host.
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu

// Chris Wellons' lowbias32: a fast 32-bit mixer with good avalanche.
__device__ __forceinline__ u32 mix32(u32 x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

// The pseudo-random value of row `i` of a column seeded with `seed`.
__device__ __forceinline__ u32 hash2(u32 seed, u64 i) {
    return mix32((u32)i ^ mix32(seed ^ mix32((u32)(i >> 32))));
}

__device__ __forceinline__ u64 global_index() {
    return (u64)blockIdx.x * (u64)blockDim.x + (u64)threadIdx.x;
}

__device__ __forceinline__ u64 grid_stride() {
    return (u64)gridDim.x * (u64)blockDim.x;
}

// Sums `v` over the block (blockDim.x a multiple of 32, at most 1024) and adds the total to `*out`
// from thread 0: one atomic per block.
__device__ __forceinline__ void block_sum_to(u64 v, u64* out) {
    __shared__ u64 warp_sums[32];
    for (int off = 16; off > 0; off >>= 1) {
        v += __shfl_down_sync(FULL_MASK, v, off);
    }
    u32 lane = threadIdx.x & 31u;
    u32 warp = threadIdx.x >> 5;
    if (lane == 0) {
        warp_sums[warp] = v;
    }
    __syncthreads();
    if (warp == 0) {
        u32 warps = blockDim.x >> 5;
        u64 w = lane < warps ? warp_sums[lane] : 0ull;
        for (int off = 16; off > 0; off >>= 1) {
            w += __shfl_down_sync(FULL_MASK, w, off);
        }
        if (lane == 0 && w != 0ull) {
            atomicAdd(out, w);
        }
    }
}
