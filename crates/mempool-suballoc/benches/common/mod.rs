//! What the benches share: one stream whose events cost nothing, so that a bench times the engines'
//! own work (on a GPU one stream's frees under `EventPolicy::Adaptive` record no event either).

use mempool_suballoc::{Error, StreamOrder};

/// A single stream whose events cost nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct OneStream;

impl StreamOrder for OneStream {
    type Stream = ();
    type Event = ();
    fn create_event(&self) -> Result<(), Error> {
        Ok(())
    }
    fn record(&self, _event: &mut (), _stream: ()) -> Result<(), Error> {
        Ok(())
    }
    fn wait(&self, _stream: (), _event: &()) -> Result<(), Error> {
        Ok(())
    }
    fn synchronize(&self, _stream: ()) -> Result<(), Error> {
        Ok(())
    }
}
