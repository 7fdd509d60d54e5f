//! The benchmark's result type: any error, said on stderr by `main`.

/// Any error, sendable between the producer's threads.
pub(crate) type AnyResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;
