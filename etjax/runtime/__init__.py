"""Running a model: jitted prefill and decode steps, sampling, and the host generation loop."""
