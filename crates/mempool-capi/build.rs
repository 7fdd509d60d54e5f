//! Compiles `src/torch_shim.cpp`, the C++ function that throws PyTorch's out-of-memory exception (see
//! `src/torch.rs`). Without a C++ compiler the crate builds without it (`cfg(mempool_cxx_shim)` unset),
//! and `mempool_torch_alloc` returns null on failure; the Python package then refuses to build its PyTorch
//! allocator and says why.

fn main() {
    println!("cargo:rustc-check-cfg=cfg(mempool_cxx_shim)");
    println!("cargo:rerun-if-changed=src/torch_shim.cpp");
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .file("src/torch_shim.cpp")
        .flag_if_supported("-std=c++17")
        .cargo_warnings(false);
    match build.try_compile("mempool_torch_shim") {
        Ok(()) => println!("cargo:rustc-cfg=mempool_cxx_shim"),
        Err(e) => println!("cargo:warning=mempool-capi: no C++ shim ({e}); PyTorch out-of-memory will not raise"),
    }
}
