//! What the C entry points of the service resource (`mempool_service_*`) and the Python package's
//! `ServiceMemoryResource` share: the resource made from plain options, tags by number or by name, and
//! sleep modes by code or by name, each refusal an [`Error::InvalidArgument`] that names the cause.

use std::sync::Arc;

use mempool_rmm::{Reclaim, ServiceOptions, ServiceResource, SleepMode, Tag};

use crate::device;
use crate::error::{Error, Result};

/// `MEMPOOL_SLEEP_DISCARD`: the code of [`SleepMode::Discard`] in the C ABI.
pub const SLEEP_DISCARD: i32 = 0;
/// `MEMPOOL_SLEEP_OFFLOAD`: the code of [`SleepMode::Offload`] in the C ABI.
pub const SLEEP_OFFLOAD: i32 = 1;

/// The options of a service resource from plain values: `max_tags` tags, `chunk_size` and `region_size`
/// bytes (`None`: the resource's defaults), the watermark in percent (`None`: reclaim idle chunks only on
/// out of memory), shareable chunks (`None`: where the device supports it).
pub fn options(
    max_tags: usize,
    chunk_size: Option<usize>,
    region_size: Option<usize>,
    watermark_percent: Option<u32>,
    shareable: Option<bool>,
) -> ServiceOptions {
    ServiceOptions {
        max_tags,
        chunk_size,
        region_size,
        reclaim: watermark_percent.map_or(Reclaim::OnOutOfMemory, |percent| Reclaim::Watermark { percent }),
        shareable,
        ..ServiceOptions::default()
    }
}

/// A service resource on device `ordinal` laid out as `options` says.
pub fn create(ordinal: usize, options: ServiceOptions) -> Result<Arc<ServiceResource>> {
    Ok(ServiceResource::new(&device::device(ordinal)?, options)?)
}

/// The names of the resource's tags, in tag order.
pub fn tag_names(mr: &ServiceResource) -> Vec<String> {
    (0..u32::MAX).map_while(|i| mr.tag_name(Tag::from_index(i))).collect()
}

/// The tag whose number is `number`; refused when the resource has no such tag (the message lists the
/// tags it has).
pub fn tag_by_number(mr: &ServiceResource, number: u64) -> Result<Tag> {
    u32::try_from(number)
        .ok()
        .map(Tag::from_index)
        .filter(|t| mr.tag_name(*t).is_some())
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "tag {number} is not one of this service resource's tags (it has {})",
                listed(mr)
            ))
        })
}

/// The existing tag named `name`; refused when there is none (the message lists the tags there are, and
/// how to make one).
pub fn tag_by_name(mr: &ServiceResource, name: &str) -> Result<Tag> {
    mr.find_tag(name).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "the service resource has no tag named {name:?} (it has {}; make one with its tag call first)",
            listed(mr)
        ))
    })
}

/// The tag named `name`, made now if there is none. A name that is not a tag name, or one more tag than
/// the resource has room for, is refused as an invalid argument naming the cause.
pub fn tag_or_new(mr: &ServiceResource, name: &str) -> Result<Tag> {
    mr.tag(name).map_err(|e| match e {
        mempool_rmm::Error::Unsupported { reason, .. } => {
            Error::InvalidArgument(format!("service resource tag {name:?}: {reason}"))
        }
        other => other.into(),
    })
}

fn listed(mr: &ServiceResource) -> String {
    let names: Vec<String> = tag_names(mr)
        .into_iter()
        .enumerate()
        .map(|(i, n)| format!("{i} `{n}`"))
        .collect();
    names.join(", ")
}

/// The sleep mode whose C code is `code` (`MEMPOOL_SLEEP_DISCARD`, `MEMPOOL_SLEEP_OFFLOAD`).
pub fn mode_of_code(code: i32) -> Result<SleepMode> {
    match code {
        SLEEP_DISCARD => Ok(SleepMode::Discard),
        SLEEP_OFFLOAD => Ok(SleepMode::Offload),
        other => Err(Error::InvalidArgument(format!(
            "sleep mode {other} is neither MEMPOOL_SLEEP_DISCARD ({SLEEP_DISCARD}) nor MEMPOOL_SLEEP_OFFLOAD \
             ({SLEEP_OFFLOAD})"
        ))),
    }
}

/// The C code of `mode`.
pub fn mode_code(mode: SleepMode) -> i32 {
    match mode {
        SleepMode::Discard => SLEEP_DISCARD,
        SleepMode::Offload => SLEEP_OFFLOAD,
    }
}

/// The sleep mode named `name` (`"discard"`, `"offload"`), as Python names them.
pub fn mode_of_name(name: &str) -> Result<SleepMode> {
    match name {
        "discard" => Ok(SleepMode::Discard),
        "offload" => Ok(SleepMode::Offload),
        other => Err(Error::InvalidArgument(format!(
            "sleep mode {other:?} is neither \"offload\" (keep the contents in pinned host memory) nor \
             \"discard\" (lose them)"
        ))),
    }
}

/// The Python name of `mode`.
pub fn mode_name(mode: SleepMode) -> &'static str {
    match mode {
        SleepMode::Discard => "discard",
        SleepMode::Offload => "offload",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_round_trip_and_others_are_refused_by_name() {
        for mode in [SleepMode::Discard, SleepMode::Offload] {
            assert_eq!(mode_of_code(mode_code(mode)).unwrap(), mode);
            assert_eq!(mode_of_name(mode_name(mode)).unwrap(), mode);
        }
        let e = mode_of_code(7).unwrap_err().to_string();
        assert!(e.contains("sleep mode 7") && e.contains("MEMPOOL_SLEEP_OFFLOAD"), "{e}");
        let e = mode_of_name("Offload").unwrap_err().to_string();
        assert!(e.contains("\"Offload\"") && e.contains("\"discard\""), "{e}");
    }

    #[test]
    fn options_map_none_to_the_resources_defaults_and_no_watermark_to_on_out_of_memory() {
        let o = options(3, None, Some(1 << 30), Some(15), Some(false));
        assert_eq!(o.max_tags, 3);
        assert_eq!((o.chunk_size, o.region_size), (None, Some(1 << 30)));
        assert_eq!(o.reclaim, Reclaim::Watermark { percent: 15 });
        assert_eq!(o.shareable, Some(false));
        assert_eq!(o.gpu_direct_rdma, ServiceOptions::default().gpu_direct_rdma);
        assert_eq!(options(8, None, None, None, None).reclaim, Reclaim::OnOutOfMemory);
    }
}
