// The fill kernel of pool_stall.c (mode 'k'), compiled to PTX on the GPU machine by scripts/repro-stall.sh.
extern "C" __global__ void fill_u32(unsigned *p, unsigned value, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x)
        p[i] = value;
}
