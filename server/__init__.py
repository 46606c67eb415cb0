"""Engine, scheduler, HTTP API and CLI of kvserve."""
