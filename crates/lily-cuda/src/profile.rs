//! Per-op timing of a forward pass, for the decode and prefill ledgers (`lily profile`,
//! docs/PERF.md). While a [`Device`] records, each [`Device::mark`] the model makes before an op
//! records a timing event on the stream, with the op's label, its layer, and the bytes and
//! floating-point operations it must at least move and do; segment i is the GPU time from mark i to
//! mark i + 1 (the last one ends at the end event of [`Device::stop_recording`]). Launched one by one,
//! the ops are queued behind a GPU spin, so they run back to back and the events measure the GPU, not
//! the host's launch rate; each segment then holds one op's kernels plus the gap before the next
//! (a few microseconds between eager launches). Recorded inside a stream capture, the events become
//! nodes of the captured graph, and every replay of it re-records them ([`Recording::segments`] after
//! each): the gaps are then the graph's own.

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

/// The marks of a recording and its end event.
pub struct Recording {
    marks: Vec<Mark>,
    end: CudaEvent,
}

impl Recording {
    /// Waits for the end event and returns every segment in order (after each replay, for a captured one).
    pub fn segments(&self) -> Result<Vec<Segment>> {
        self.end.synchronize()?;
        let mut out = Vec::with_capacity(self.marks.len());
        for (i, m) in self.marks.iter().enumerate() {
            let next = self.marks.get(i + 1).map(|n| &n.event).unwrap_or(&self.end);
            let ms = m.event.elapsed_ms(next)?;
            out.push(Segment { label: m.label, layer: m.layer, bytes: m.bytes, flops: m.flops, seconds: ms as f64 * 1e-3 });
        }
        Ok(out)
    }
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

    /// Knocks out an op (the decode ledger's marginal costs): while `label` is set, every kernel
    /// launched between a mark of that label and the next mark is skipped, so a step captured then
    /// costs what it does without that op. Its results are wrong: for timing only. `None` ends it.
    pub fn set_knockout(&self, label: Option<&'static str>) {
        *self.knockout.lock().unwrap() = (label, "");
        self.knocking.store(label.is_some(), std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the op being launched is knocked out ([`Device::set_knockout`]); counts the launch skipped.
    pub(crate) fn knocked_out(&self) -> bool {
        if !self.knocking.load(std::sync::atomic::Ordering::Relaxed) {
            return false;
        }
        let k = self.knockout.lock().unwrap();
        let skip = k.0 == Some(k.1);
        if skip {
            self.knocked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        skip
    }

    /// Kernel launches knock-outs have skipped so far.
    pub fn knocked_launches(&self) -> u64 {
        self.knocked.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Begins the segment of an op (ends the previous one). Free when not recording.
    pub fn mark(&self, label: &'static str, bytes: u64, flops: u64) -> Result<()> {
        if self.knocking.load(std::sync::atomic::Ordering::Relaxed) {
            self.knockout.lock().unwrap().1 = label;
        }
        let mut rec = self.recorder.lock().unwrap();
        let Some((marks, layer)) = rec.as_mut() else { return Ok(()) };
        let event = self.context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        self.record_event(&event)?;
        marks.push(Mark { label, layer: *layer, bytes, flops, event });
        Ok(())
    }

    /// Records `e` on the stream; inside a stream capture, as an event-record node of the graph
    /// (`CU_EVENT_RECORD_EXTERNAL`: a plain record there would only order the capture).
    fn record_event(&self, e: &CudaEvent) -> Result<()> {
        use cudarc::driver::sys;
        let st = self.stream().cu_stream();
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: st is this device's live stream; status is a valid out-pointer.
        unsafe { sys::cuStreamIsCapturing(st, &mut status) }.result()?;
        let flags = if status == sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE {
            sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32
        } else {
            0
        };
        // SAFETY: the event and the stream belong to this device's context, which is current.
        self.context().bind_to_thread()?;
        unsafe { sys::cuEventRecordWithFlags(e.cu_event(), st, flags) }.result()?;
        Ok(())
    }

    /// Ends the last segment (an end event on the stream, or in the capture under way) and stops
    /// recording.
    pub fn stop_recording(&self) -> Result<Recording> {
        let marks = self.recorder.lock().unwrap().take().map(|(m, _)| m).unwrap_or_default();
        let end = self.context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        self.record_event(&end)?;
        Ok(Recording { marks, end })
    }

    /// [`Device::stop_recording`], then the segments.
    pub fn finish_recording(&self) -> Result<Vec<Segment>> {
        self.stop_recording()?.segments()
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
