"""specdec: speculative decoding served through NVIDIA Triton Inference Server."""

import os

# torch's OpenMP threads and the native decoder's thread pool (core/models/native) share the
# cores. libgomp's idle threads spin for a while after each parallel op by default, on the core a
# native worker needs next: at 2 threads an 8 x 5 verification ran 0.92x the one-thread call
# where with sleeping OpenMP threads it ran 1.73x. libgomp reads this when torch loads, so it is
# set on importing specdec (before torch, for `specdec ...` and `python -m specdec...`) and in
# tritonserver's environment (`serving.server.server_env`); a value already set is kept.
OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
for _name, _value in OPENMP_ENV.items():
    os.environ.setdefault(_name, _value)
