// Kernels of the multi-stream and peer workloads: fill a buffer with hashed values, grind on it for a
// while (real ALU work, not a sleep), sum it, and copy with 16-byte loads (peer bandwidth).
//
// Build: kernels/build-ptx.sh (nvcc -ptx -arch=compute_80). The harness loads work.ptx through the driver.
#include "common.cuh"

// out[i] = hash2(seed, i) for i < n. One element per thread.
extern "C" __global__ void bench_fill_hash_u32(u32* out, u64 n, u32 seed) {
    u64 i = global_index();
    if (i < n) {
        out[i] = hash2(seed, i);
    }
}

// buf[i] = mix32(... mix32(buf[i] + 0) + 1 ... + rounds-1): `rounds` dependent mixes per element.
extern "C" __global__ void bench_work_u32(u32* buf, u64 n, u32 rounds) {
    u64 i = global_index();
    if (i < n) {
        u32 x = buf[i];
        for (u32 r = 0; r < rounds; r++) {
            x = mix32(x + r);
        }
        buf[i] = x;
    }
}

// *out += sum of buf[0..n) (as 64-bit integers). Grid-stride: any grid size works.
extern "C" __global__ void bench_sum_u32(const u32* buf, u64 n, u64* out) {
    u64 s = 0;
    for (u64 i = global_index(); i < n; i += grid_stride()) {
        s += buf[i];
    }
    block_sum_to(s, out);
}

// dst[i] = src[i] for i < n 16-byte items, each loaded by a thread of the launching device (so a peer's
// memory is read through its mapping, not by a copy engine). Grid-stride.
extern "C" __global__ void bench_copy_u128(uint4* dst, const uint4* src, u64 n) {
    for (u64 i = global_index(); i < n; i += grid_stride()) {
        dst[i] = src[i];
    }
}
