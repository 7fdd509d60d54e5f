//! Where `Drop` implementations put the errors they cannot return.

use std::sync::Mutex;

use crate::error::Error;

static DROP_ERRORS: Mutex<Vec<Error>> = Mutex::new(Vec::new());
const MAX_DROP_ERRORS: usize = 64;

/// Keeps an error a destructor met, for [`take_drop_errors`] (at most 64; later ones are dropped): for
/// the destructors of other crates' types over mempool-core (mempool-rmm's resources).
pub fn record(e: Error) {
    let mut errors = DROP_ERRORS.lock().unwrap_or_else(|p| p.into_inner());
    if errors.len() < MAX_DROP_ERRORS {
        errors.push(e);
    }
}

/// Takes the errors that `Drop` implementations met since the last call (at most 64 are kept).
/// Destructors cannot return errors; this is where they go instead of a panic.
pub fn take_drop_errors() -> Vec<Error> {
    std::mem::take(&mut *DROP_ERRORS.lock().unwrap_or_else(|p| p.into_inner()))
}
