//! Compiles `src/torch_shim.cpp`, the C++ function that throws PyTorch's out-of-memory exception (see
//! `src/torch.rs`). Without a C++ compiler the crate builds without it (`cfg(mempool_cxx_shim)` unset),
//! and `mempool_torch_alloc` returns null on failure; the Python package then refuses to build its PyTorch
//! allocator and says why. Under `panic = "abort"` the shim is left out too: the exception it throws
//! unwinds through a Rust frame (`extern "C-unwind"`), which aborts the process when Rust is built to
//! abort on panic.

fn main() {
    println!("cargo:rustc-check-cfg=cfg(mempool_cxx_shim)");
    println!("cargo:rerun-if-changed=src/torch_shim.cpp");
    if std::env::var("CARGO_CFG_PANIC").as_deref() == Ok("abort") {
        println!(
            "cargo:warning=mempool-capi: built with panic=abort, so the C++ shim is left out (its exception \
             would abort the process while unwinding through Rust); PyTorch out-of-memory will not raise"
        );
        return;
    }
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
