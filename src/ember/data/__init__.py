"""Keep the accelerator fed: device prefetching and an input-starvation doctor.

    for x, y in ember.data.prefetch(loader, device="cuda", dtype=torch.bfloat16, channels_last=True):
        ...
    doctor = ember.data.doctor(loader)
    for x, y in doctor: ...
    print(doctor.report())
"""

from __future__ import annotations

from ember.data.doctor import StarvationDoctor, StarvationReport, StepTimer, doctor
from ember.data.prefetch import DevicePrefetcher, PrefetchIterator, prefetch

__all__ = ["DevicePrefetcher", "PrefetchIterator", "StarvationDoctor", "StarvationReport", "StepTimer",
           "doctor", "prefetch"]
