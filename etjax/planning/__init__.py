"""Planning a deployment on TPUs from any machine: the engine's programs compiled for a named
TPU topology (libtpu, no TPU needed), what each chip would hold, and what a step would cost.

- `topology.py`: `Topology` ("v5e-1", "v6e-8", ...), its chips' HBM, bandwidth and peak
  FLOPs, and the topology's devices for compiling only; `check_libtpu`.
- `programs.py`: the engine's own step programs (a compile-only `DeviceBackend`) lowered and
  compiled for those devices; per program the compile time, the bytes per chip and the Mosaic
  kernels built.
- `plan.py`: `plan` (`etjax.plan`): weights, KV pool, row state and the programs' scratch per
  chip against HBM, the largest pool, batch and context that fit, a modelled decode step.
- `isolation.py`: a call run in a child process (`run_isolated`), so that a crash of the TPU
  compiler there (a signal in libtpu) is an error of the plan (`CompilerCrash`), not its end.
- `pool.py`: the KV pool an engine on a TPU gets, from the same plan over its own devices.
- `command.py`: `etjax plan`, the plan as text or JSON.

docs/TPU.md says what is compiled, what is modelled and what has run on a device.
"""
