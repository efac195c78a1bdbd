//! Per-op timing of a forward pass, for the decode and prefill ledgers (`lily profile`,
//! docs/PERF.md). While a [`Device`] records, each [`Device::mark`] the model makes before an op
//! records a timing event on the stream, with the op's label, its layer, and the bytes and
//! floating-point operations it must at least move and do; segment i is the GPU time from mark i to
//! mark i + 1 (the last one ends at [`Device::finish_recording`]). The model's launches are queued
//! behind a GPU spin, so they run back to back and the events measure the GPU, not the host's launch
//! rate; each segment then holds one op's kernels plus the gap before the next (about a microsecond).

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaEvent;

use crate::{Device, Result};

/// One recorded op.
pub(crate) struct Mark {
    pub label: &'static str,
    pub layer: i32,
    pub bytes: u64,
    pub flops: u64,
    pub event: CudaEvent,
}

/// One op's measured time.
#[derive(Clone, Debug)]
pub struct Segment {
    pub label: &'static str,
    /// The layer the op belongs to (-1: before or after the layers).
    pub layer: i32,
    /// Fewest bytes of device memory the op must move (each input read once, each output written once).
    pub bytes: u64,
    /// Floating-point operations of its maths (multiply-adds count two).
    pub flops: u64,
    pub seconds: f64,
}

impl Device {
    /// Starts recording marks (a no-op for [`Device::mark`] until then).
    pub fn start_recording(&self) {
        *self.recorder.lock().unwrap() = Some((Vec::new(), -1));
    }

    /// Whether marks are being recorded.
    pub fn recording(&self) -> bool {
        self.recorder.lock().unwrap().is_some()
    }

    /// The layer later marks belong to.
    pub fn set_layer(&self, layer: i32) {
        if let Some((_, l)) = self.recorder.lock().unwrap().as_mut() {
            *l = layer;
        }
    }

    /// Begins the segment of an op (ends the previous one). Free when not recording.
    pub fn mark(&self, label: &'static str, bytes: u64, flops: u64) -> Result<()> {
        let mut rec = self.recorder.lock().unwrap();
        let Some((marks, layer)) = rec.as_mut() else { return Ok(()) };
        let event = self.context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        event.record(self.stream())?;
        marks.push(Mark { label, layer: *layer, bytes, flops, event });
        Ok(())
    }

    /// Ends the last segment, waits for the GPU, and returns every segment in order.
    pub fn finish_recording(&self) -> Result<Vec<Segment>> {
        let Some((marks, _)) = self.recorder.lock().unwrap().take() else { return Ok(Vec::new()) };
        let end = self.context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        end.record(self.stream())?;
        end.synchronize()?;
        let mut out = Vec::with_capacity(marks.len());
        for (i, m) in marks.iter().enumerate() {
            let next = marks.get(i + 1).map(|n| &n.event).unwrap_or(&end);
            let ms = m.event.elapsed_ms(next)?;
            out.push(Segment { label: m.label, layer: m.layer, bytes: m.bytes, flops: m.flops, seconds: ms as f64 * 1e-3 });
        }
        Ok(out)
    }

    /// Device-to-device copy bandwidth in bytes per second (bytes read plus bytes written), measured
    /// on two buffers of `bytes` each: the ceiling the ledger's shares are taken against.
    pub fn copy_bandwidth(&self, bytes: usize) -> Result<f64> {
        let n = (bytes / 4).max(1 << 20);
        let a = self.zeros::<f32>(n)?;
        let mut b = self.zeros::<f32>(n)?;
        let (e0, e1) = (
            self.context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
            self.context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
        );
        self.stream().memcpy_dtod(&a, &mut b)?; // warm-up
        let reps = 10;
        let mut best = f64::MAX;
        for _ in 0..3 {
            e0.record(self.stream())?;
            for _ in 0..reps {
                self.stream().memcpy_dtod(&a, &mut b)?;
            }
            e1.record(self.stream())?;
            best = best.min(e0.elapsed_ms(&e1)? as f64 * 1e-3 / reps as f64);
        }
        Ok(2.0 * 4.0 * n as f64 / best)
    }
}
